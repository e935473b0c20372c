"""Incremental detokenization: multi-byte characters and stop strings across tokens."""

from __future__ import annotations

import pytest

from helpers.tiny_models import build_tokenizer
from qwenserve.engine.detokenizer import IncrementalDetokenizer
from qwenserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, text, **params):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams(**params))
    deltas, stop = [], None
    for i, token_id in enumerate(ids):
        stop = detok.update([token_id])
        deltas.append(detok.next_delta(finished=stop is not None or i == len(ids) - 1))
        if stop:
            break
    return deltas, detok, stop


@pytest.mark.parametrize("text", ["你好，世界。今天天气很好。", "emoji 😀🚀 and café", "plain ascii"])
def test_deltas_never_split_characters_and_join_to_the_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 3
    deltas, detok, _ = stream(tok, text)
    assert "".join(deltas) == text == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok):
    text = "Hello world! How are you today?"
    deltas, detok, stop = stream(tok, text, stop=["d! H"])
    assert stop == "d! H"
    assert detok.output_text == "Hello worl"
    assert "".join(deltas) == "Hello worl"


def test_include_stop_string(tok):
    _, detok, stop = stream(tok, "Hello world! How are you", stop=["world"],
                            include_stop_str_in_output=True)
    assert stop == "world" and detok.output_text == "Hello world"


def test_earliest_stop_string_wins(tok):
    _, detok, stop = stream(tok, "The capital of France is Paris.", stop=["Paris", "capital"])
    assert stop == "capital" and detok.output_text == "The "
