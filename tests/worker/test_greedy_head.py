"""The fused greedy LM head in the engine (``CausalLM.greedy_tokens``, ``Backends.greedy_head``):
a step whose sampled rows are all plain greedy takes the tokens from the kernel, without logits,
and they are the tokens of the same engine with the kernel off; a step with any row that needs
the logits (sampling, logprobs, a penalty, a bias, a grammar, drafts) computes them as before."""

from __future__ import annotations

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.native.gemm import bgemm
from qwenserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.skipif(bgemm() is None, reason="no AMX tiles (or no compiler) here")

PROMPTS = [[(5 * i + 11 * j) % 400 + 1 for j in range(n)] for i, n in enumerate((9, 17, 4, 30))]


def _engine(path: str) -> LLM:
    return LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=16 << 20)


def _count_calls(llm: LLM) -> list[int]:
    """Rows of each call the LM head's fused greedy kernel took."""
    head = llm.llm_engine.executor.worker.model.lm_head
    calls, kernel = [], head.greedy_head

    def counted(hidden, weight):
        tokens = kernel(hidden, weight)
        if tokens is not None:
            calls.append(hidden.shape[0])
        return tokens

    head.greedy_head = counted
    return calls


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_greedy_steps_take_the_kernel_and_keep_the_tokens(tiny_model, arch):
    path = tiny_model(arch)
    fused, plain = _engine(path), _engine(path)
    calls = _count_calls(fused)
    plain.llm_engine.executor.worker.model.lm_head.greedy_head = None
    greedy = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(PROMPTS)
    assert _tokens(fused, greedy) == _tokens(plain, greedy)
    assert calls and max(calls) == len(PROMPTS)  # the 4-row decode steps took it
    for llm in (fused, plain):
        llm.llm_engine.shutdown()


def test_a_row_that_needs_the_logits_keeps_them_for_its_steps(tiny_model):
    """Beside three greedy rows, one that samples, asks for logprobs, has a penalty, a bias or
    a grammar: no step of that batch takes the kernel (until that request finishes), and the
    greedy rows' tokens are the plain engine's."""
    path = tiny_model("qwen2")
    fused, plain = _engine(path), _engine(path)
    calls = _count_calls(fused)
    plain.llm_engine.executor.worker.model.lm_head.greedy_head = None
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    needs_logits = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, logit_bias={7: 3.0}, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12,
                       structured_outputs=StructuredOutputsParams(regex="[ab]+")),
    ]
    for other in needs_logits:
        calls.clear()
        params = [greedy, other, greedy, greedy]
        assert _tokens(fused, params) == _tokens(plain, params), other
        # the others run all 12 tokens; the grammar's request may end first, and then the
        # three greedy rows left take the kernel
        assert calls == [] if other.structured_outputs is None else len(PROMPTS) not in calls
    for llm in (fused, plain):
        llm.llm_engine.shutdown()
