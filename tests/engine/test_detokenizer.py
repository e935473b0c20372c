"""Incremental detokenization: multi-byte characters and stop strings across tokens."""

from __future__ import annotations

import pytest

from helpers.tiny_models import build_tokenizer
from qwenserve.engine.detokenizer import IncrementalDetokenizer, token_decoder
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


def test_backend_decoder_returns_what_transformers_decode_does(tok):
    """The fast path (the tokenizers backend, asked directly) is taken for a plain fast
    tokenizer and gives the same text, special tokens kept or skipped."""
    decode = token_decoder(tok)
    assert decode.__closure__ is not None
    assert any(cell.cell_contents is tok.backend_tokenizer for cell in decode.__closure__)
    ids = tok.encode("<|im_start|>你好 😀 café<|im_end|> plain", add_special_tokens=False)
    for skip in (False, True):
        for end in range(1, len(ids) + 1):
            assert decode(ids[:end], skip) == tok.decode(ids[:end], skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    cleaning = build_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    decode = token_decoder(cleaning)
    assert not any(cell.cell_contents is cleaning.backend_tokenizer
                   for cell in decode.__closure__ or ())
