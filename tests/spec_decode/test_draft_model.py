"""A tiny model drafting for another (same vocabulary): greedy output identical to plain
decoding, with chunked prefill, prefix caching and preemption; a drafter identical to the
target (the rigged case) has its drafts accepted nearly always."""

from __future__ import annotations

import pytest

from qwenserve import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), [7, 300, 12, 7, 300, 12, 7], [42] * 9,
           list(range(100, 130)) + list(range(100, 110))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _llm(path, **kw):
    return LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
               block_size=16, **kw)


def ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def expected(target):
    return ids(_llm(target))


@pytest.mark.parametrize("drafter", ["same", "llama"])
def test_draft_model_greedy_identical(tiny_model, target, expected, drafter):
    path = target if drafter == "same" else tiny_model("llama", seed=1)
    llm = _llm(target, num_gpu_blocks_override=8, speculative_config={
        "method": "draft_model", "model": path, "num_speculative_tokens": 3})
    assert ids(llm) == expected
    assert ids(llm, PROMPTS[1:2]) == expected[1:2]  # a prefix-cache hit
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0
    totals = sched.spec_totals
    assert totals.num_drafts > 0
    if drafter == "same":
        assert totals.num_accepted_tokens / totals.num_draft_tokens > 0.95
    # max_tokens ending mid-draft
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert ids(llm, params=params) == [e[:6] for e in expected]


def test_draft_model_kv_is_in_the_budget(target):
    plain = _llm(target, kv_cache_memory_bytes=1 << 20)
    spec = _llm(target, kv_cache_memory_bytes=1 << 20, speculative_config={
        "method": "draft_model", "model": target, "num_speculative_tokens": 2})
    assert spec.llm_engine.plan.num_blocks * 2 == plain.llm_engine.plan.num_blocks


def test_draft_model_vocabulary_must_match(tiny_model, target):
    other = tiny_model("qwen2", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(target, speculative_config={"method": "draft_model", "model": other,
                                         "num_speculative_tokens": 2})
