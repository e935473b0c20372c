"""Expert parallelism (``--enable-expert-parallel``) on CPU (gloo): experts whole per rank give the
same greedy tokens as one device on each MoE architecture (TP=2 alone is checked against one
device in test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.layers.moe import SparseMoeBlock

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [7, 300, 12]]


def greedy(path: str, tp: int, ep: bool) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens, and how many experts the driver rank holds in each MoE layer."""
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=32,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=tp,
              enable_expert_parallel=ep)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    model = llm.llm_engine.executor.worker.model
    held = [m.experts.w13.shape[0] for m in model.modules() if isinstance(m, SparseMoeBlock)]
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], held


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])  # qwen3_5_moe: same MoEBlock
def test_ep2_equals_one_device(tiny_model, arch):
    path = tiny_model(arch)
    one, all_experts = greedy(path, 1, False)
    ep, halves = greedy(path, 2, True)
    assert ep == one
    assert halves and [2 * n for n in halves] == all_experts  # whole experts, half per rank
