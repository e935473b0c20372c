"""``prompt_logprobs``: every prompt token scored against HF's logits (what lm-eval's
loglikelihood tasks read), under chunked prefill, preemption, prefix caching and TP=2."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.tiny_models import hf_logits, load_hf_model
from qwenserve import LLM, SamplingParams
from qwenserve.sampling_params import RequestOutputKind

rng = random.Random(5)
PROMPTS = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 2, 17, 40, 70)]


@pytest.fixture(scope="module")
def model(tiny_model):
    path = tiny_model("qwen2")
    hf = load_hf_model(path)
    refs = [torch.log_softmax(hf_logits(hf, p), dim=-1) for p in PROMPTS]
    return path, refs


def params(k: int = 3, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=k, **kw)


def check_against_hf(outs, refs, k: int = 3) -> None:
    for prompt, ref, out in zip(PROMPTS, refs, outs):
        scored = out.prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        for pos in range(1, len(prompt)):
            row, token = ref[pos - 1], prompt[pos]
            entry = scored[pos]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(k).indices.tolist()
            assert sorted(entry.items(), key=lambda kv: kv[1].rank)[:k] == [
                (t, entry[t]) for t in top]
            assert len(entry) == len(set(top) | {token})
            assert next(iter(entry)) == token  # the scored token comes first, as in vLLM


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=16),  # every prompt longer than 16 is scored over chunks
    dict(max_num_batched_tokens=64, num_gpu_blocks_override=8),  # forces preemption
])
def test_prompt_logprobs_equal_hf(model, engine_kw):
    path, refs = model
    llm = LLM(path, dtype="float32", max_model_len=128, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params())
    check_against_hf(outs, refs)
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_cached_prefix_is_scored_again_and_k_zero_gives_the_token_only(model):
    path, refs = model
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params(k=0, n=2))  # fills the cache
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params(k=0))
    check_against_hf(outs, refs, k=0)
    assert all(len(entry) == 1 for out in outs for entry in out.prompt_logprobs[1:])
    assert llm.llm_engine.cache.usage() == 0.0


def test_streamed_request_gets_prompt_logprobs_once(model):
    path, _ = model
    llm = LLM(path, dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[3], params(output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    with_scores = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(outputs) == 4 and with_scores == outputs[:1]


def test_too_many_prompt_logprobs_is_refused(model):
    path, _ = model
    llm = LLM(path, dtype="float32", max_model_len=128, max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs 6 is more than the engine's max_logpr"):
        llm.generate([{"prompt_token_ids": [1, 2]}], params(k=6))
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=-1)


def test_tensor_parallel_prompt_logprobs(model):
    path, refs = model
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
              tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params())
    finally:
        llm.llm_engine.shutdown()
    check_against_hf(outs, refs)

