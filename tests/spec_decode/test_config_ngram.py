"""--speculative-config parsing and the n-gram prompt-lookup proposer (no torch)."""

from __future__ import annotations

import pytest

from qwenserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from qwenserve.spec_decode.ngram import NgramProposer


def test_parse_ngram_json_and_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                 '"prompt_lookup_max": 4}')
    assert c == SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    assert parse_speculative_config(None) is None
    c = parse_speculative_config({"model": "/m", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model == "/m"


def test_parse_mtp_methods_and_default_tokens():
    for method in ("mtp", "qwen3_5_mtp", "qwen3_next_mtp"):
        c = parse_speculative_config({"method": method, "num_speculative_tokens": 3,
                                      "enforce_eager": True})
        assert c == SpeculativeConfig("mtp", 3)
    # No num_speculative_tokens: the checkpoint's mtp_num_hidden_layers, as vLLM's n_predict.
    assert parse_speculative_config('{"method": "qwen3_5_mtp"}').num_speculative_tokens == 1
    assert parse_speculative_config({"method": "mtp"}, mtp_layers=2).num_speculative_tokens == 2


@pytest.mark.parametrize("value, words", [
    ('{"method": "eagle3", "num_speculative_tokens": 2}', 'eagle3 needs "model"'),
    ('{"method": "eagle3", "model": "/h", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
     "prompt_lookup_max"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "EAGLE heads are not implemented"),
    ('{"method": "qwen3_5_mtp", "model": "/m"}', "model"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
     "prompt_lookup_max"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "foo"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}',
     "draft_tensor_parallel_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 3}', "prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ("not json", "JSON"),
    ('{"method": "nope", "num_speculative_tokens": 2}', "nope"),
])
def test_parse_refuses_by_name(value, words):
    with pytest.raises(ValueError, match=words):
        parse_speculative_config(value)


def test_ngram_proposes_continuation_of_latest_match():
    p = NgramProposer(min_n=2, max_n=3, num_tokens=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3]
    # suffix [2, 3]: latest earlier occurrence at 6 -> followed by 7, 2, 3
    assert p.propose(tokens) == [7, 2, 3]
    # the longest n wins: suffix [9, 2, 3] occurs at 5 in the second sequence
    assert p.propose([9, 2, 3, 8, 8, 2, 3, 6, 9, 2, 3]) == [8, 8, 2]
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert p.propose([5]) == []
    assert p.propose(tokens, max_tokens=1) == [7]


def test_ngram_copy_workload_proposes_the_prompt():
    text = list(range(100, 140))
    p = NgramProposer(min_n=1, max_n=4, num_tokens=5)
    assert p.propose(text + [0] + text[:10]) == text[10:15]


def test_eagle3_parses_with_its_head():
    """The vLLM Ascend tutorials' form: the head's folder in "model"; k - 1 lookahead slots."""
    from qwenserve.spec_decode.config import mtp_lookahead_tokens

    c = parse_speculative_config('{"method": "eagle3", "model": "/heads/qwen3-8b-eagle3", '
                                 '"num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle3", "/heads/qwen3-8b-eagle3", 3)
    assert mtp_lookahead_tokens(c) == 2
