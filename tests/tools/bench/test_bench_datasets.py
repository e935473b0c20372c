"""Datasets: ShareGPT layout and pruning, random and repeated-prefix prompts, warm-up prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from qwenserve.tools.bench.datasets import (
    DatasetSpec,
    build_workload,
    check_spec,
    load_sharegpt,
    sample_sharegpt,
)
from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.tokenizer import HFTokenizer, ServerTokenizer


@pytest.fixture(scope="module")
def hf_tok(tiny_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer.load(str(tiny_tokenizer_dir))


def test_sharegpt_layout_and_filter(sharegpt_path: Path, hf_tok: HFTokenizer) -> None:
    entries = load_sharegpt(str(sharegpt_path))
    assert len(entries) == 16  # one-turn and non-conversation entries are dropped
    spec = DatasetSpec(name="sharegpt", path=str(sharegpt_path), num_prompts=100, seed=0)
    samples = sample_sharegpt(entries, hf_tok, spec, 100)
    ids = {s.request_id for s in samples}
    assert len(ids) == len(samples)
    for s in samples:
        assert 4 <= s.prompt_len <= 1024 and s.expected_output_len >= 4
        assert s.prompt_len == len(hf_tok.encode(s.prompt, add_special_tokens=True))
    assert "ok" not in [e["conversations"][1]["value"] for e in entries if e["id"] == "x"]
    texts = {s.prompt for s in samples}
    short_answer = next(e for e in entries if e["id"] == "short-answer")
    assert short_answer["conversations"][0]["value"] not in texts  # output "ok" < 4 tokens


def test_sharegpt_order_is_vllms_seeded_shuffle(sharegpt_path: Path, hf_tok: HFTokenizer) -> None:
    entries = load_sharegpt(str(sharegpt_path))
    spec = DatasetSpec(name="sharegpt", path=str(sharegpt_path), num_prompts=3, seed=5)
    expected = list(entries)
    random.seed(5)  # vLLM: random.seed(seed); random.shuffle(data)
    random.shuffle(expected)
    got = [s.prompt for s in sample_sharegpt(entries, hf_tok, spec, 3)]
    firsts = [e["conversations"][0]["value"] for e in expected]
    assert got == [p for p in firsts if p in got][:3] and got[0] == firsts[0]


def test_sharegpt_output_len_override_and_oversample(
    sharegpt_path: Path, hf_tok: HFTokenizer
) -> None:
    spec = DatasetSpec(name="sharegpt", path=str(sharegpt_path), num_prompts=40,
                       sharegpt_output_len=7, request_id_prefix="r-")  # fmt: skip
    measured, warmup = build_workload(spec, hf_tok, 3, check_spec(spec))
    assert len(measured) == 40 and all(s.expected_output_len == 7 for s in measured)
    assert len({s.request_id for s in measured}) == 40
    assert len(warmup) == 3 and all(w.request_id.startswith("r-warmup-") for w in warmup)


def test_sharegpt_warmup_uses_other_conversations(sharegpt_path: Path, hf_tok: HFTokenizer) -> None:
    spec = DatasetSpec(name="sharegpt", path=str(sharegpt_path), num_prompts=5)
    measured, warmup = build_workload(spec, hf_tok, 4, check_spec(spec))
    assert {s.prompt for s in measured}.isdisjoint({w.prompt for w in warmup})
    alone, _ = build_workload(spec, hf_tok, 0, check_spec(spec))
    assert [s.prompt for s in alone] == [s.prompt for s in measured]  # warm-up changes nothing


def test_random_prompts_have_exact_lengths(hf_tok: HFTokenizer) -> None:
    spec = DatasetSpec(name="random", num_prompts=12, random_input_len=48, random_output_len=9,
                       random_range_ratio=0.25, random_prefix_len=8, seed=3)  # fmt: skip
    measured, warmup = build_workload(spec, hf_tok, 2)
    assert len(measured) == 12 and len(warmup) == 2
    for s in measured:
        assert s.prompt_len == len(hf_tok.encode(s.prompt))
        assert 8 + 36 <= s.prompt_len <= 8 + 60
        assert 6 <= s.expected_output_len <= 12
    prefixes = {tuple(hf_tok.encode(s.prompt)[:4]) for s in measured}
    assert len(prefixes) == 1  # the shared random prefix
    assert [s.prompt for s in build_workload(spec, hf_tok, 0)[0]] == [s.prompt for s in measured]
    assert not {s.prompt for s in measured} & {w.prompt for w in warmup}


def test_prefix_repetition_shares_prefixes(hf_tok: HFTokenizer) -> None:
    spec = DatasetSpec(name="prefix-repetition", num_prompts=8, prefix_len=16, suffix_len=8,
                       num_prefixes=2, prefix_output_len=5)  # fmt: skip
    measured, warmup = build_workload(spec, hf_tok, 3)
    assert len(measured) == 8 and len(warmup) == 3
    heads = [tuple(hf_tok.encode(s.prompt)[:10]) for s in measured]
    assert len(set(heads)) == 2 and sorted(heads.count(h) for h in set(heads)) == [4, 4]
    assert all(s.expected_output_len == 5 for s in measured)
    # vLLM's prompt_len is the token count of prefix + suffix; random bytes may not round-trip
    assert all(abs(s.prompt_len - 24) <= 4 for s in measured)
    assert {tuple(hf_tok.encode(w.prompt)[:10]) for w in warmup}.isdisjoint(heads)


def test_random_prompts_through_the_server_tokenizer(fake_server) -> None:  # noqa: ANN001
    tok = ServerTokenizer(fake_server.base_url, "fake-model", {})
    spec = DatasetSpec(name="random", num_prompts=5, random_input_len=20, random_output_len=4)
    measured, _ = build_workload(spec, tok, 0)
    assert [s.prompt_len for s in measured] == [20] * 5
    assert all(len(s.prompt.split()) == 20 for s in measured)  # the fake tokenizer: one word each
    tok.close()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "dataset file not found"),
        ("{not json", "is not valid JSON"),
        ('{"conversations": []}', "expected a JSON list"),
        ('[{"conversations": [{"from": "human", "value": "only one turn"}]}]', "no entry has"),
        ('[{"conversations": [{"from": "human"}, {"from": "gpt"}]}]', "no entry has"),
    ],
)
def test_bad_sharegpt_files(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BenchError, match=message):
        load_sharegpt(str(path))


def test_spec_checks() -> None:
    with pytest.raises(BenchError, match="needs --dataset-path"):
        check_spec(DatasetSpec(name="sharegpt"))
    with pytest.raises(BenchError, match="takes no --dataset-path"):
        check_spec(DatasetSpec(name="random", path="x.json"))
    with pytest.raises(BenchError, match="range-ratio"):
        check_spec(DatasetSpec(name="random", random_range_ratio=1.0))
    with pytest.raises(BenchError, match="num-prefixes"):
        check_spec(DatasetSpec(name="prefix-repetition", num_prompts=3, num_prefixes=4))
    with pytest.raises(BenchError, match="num-prompts"):
        check_spec(DatasetSpec(num_prompts=0))


def test_sample_file_is_the_usual_layout(sharegpt_path: Path) -> None:
    data = json.loads(sharegpt_path.read_text())
    turn = data[0]["conversations"][0]
    assert set(turn) == {"from", "value"} and turn["from"] == "human"
