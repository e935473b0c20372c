"""Speculative decoding at TP=2 on CPU (gloo): every method, on dense, MoE and hybrid targets,
gives greedy output identical token for token to the same model at TP=1 without speculation,
on a batch mixing prompt lengths, with chunked prefill (16-token budget), forced preemption
(a 5-block cache) and a prefix-cache hit.

The heads run sharded on both ranks in lock-step (``spec_decode/lockstep.py``); random heads
reject nearly every draft, so hybrid targets roll their recurrent state back on both ranks
nearly every step. A rigged MTP head (rigged in the rank process too) accepts nearly all.
"""

from __future__ import annotations

import pytest

from helpers.spec_decode import gen, ids, rig_every_rank, spec_llm, totals
from helpers.tiny_models import add_mtp_head, make_eagle3_head
from qwenserve import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(10, 40)), [7, 300, 12, 7, 300, 12, 7],
           list(range(100, 130)) + list(range(100, 110))]
MAX_TOKENS = 16
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_EXPECTED: dict[str, list[list[int]]] = {}


def expected(path: str) -> list[list[int]]:
    """Greedy tokens at TP=1 without speculation (once per checkpoint)."""
    if path not in _EXPECTED:
        llm = spec_llm(path)
        _EXPECTED[path] = ids(gen(llm, GREEDY, PROMPTS))
        llm.llm_engine.shutdown()
    return _EXPECTED[path]


def run_tp2(path: str, spec: dict, per_pos: bool = False) -> tuple[int, int, int]:
    """Check TP=2 with ``spec`` against TP=1 plain; returns the spec counters (``per_pos``:
    and checks the per-position accepted counts, vLLM's metric, add up)."""
    want = expected(path)
    llm = spec_llm(path, max_model_len=64, tensor_parallel_size=2, speculative_config=spec,
                   num_gpu_blocks_override=5)
    try:
        assert ids(gen(llm, GREEDY, PROMPTS)) == want
        for _ in range(2):  # a hybrid model's first repeat saves the checkpoint it hits next
            again = gen(llm, GREEDY, PROMPTS[2:3])
            assert ids(again) == want[2:3]
        assert again[0].num_cached_tokens > 0
        assert llm.llm_engine.scheduler.num_preemptions > 0
        counts = totals(llm)
        assert counts[0] > 0  # drafts were verified
        if per_pos:
            by_pos = llm.llm_engine.scheduler.spec_totals.num_accepted_tokens_per_pos
            assert len(by_pos) == K and by_pos[K - 1] > 0 and sum(by_pos) == counts[2]
        return counts
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_5",
                                  pytest.param("qwen3_5_moe", marks=pytest.mark.benchmark),
                                  pytest.param("qwen3_next", marks=pytest.mark.benchmark)])
def test_mtp(tiny_model, arch):
    """(Qwen3-Next's head is Qwen3.5-MoE's class: under QWENSERVE_RUN_BENCHMARKS=1, for CI
    time, as in test_mtp.py. So is Qwen3.5-MoE's at TP 2: the lock-step and the hybrid rollback
    on both ranks are the dense case's, and its MoE head runs sharded at TP 2 in CI in
    test_data_parallel_spec.py[dp_ep_tp2].)"""
    path = add_mtp_head(tiny_model(arch, mtp_num_hidden_layers=1))
    run_tp2(path, {"method": f"{'qwen3_next' if arch == 'qwen3_next' else 'qwen3_5'}_mtp",
                   "num_speculative_tokens": K})


@pytest.mark.parametrize("arch", [pytest.param("qwen3", marks=pytest.mark.benchmark),
                                  "qwen3_moe"])
def test_eagle3(tiny_model, tmp_path_factory, arch):
    """The MoE target with auxiliary layers and ``norm_before_residual`` in CI; the dense
    target (the same head and lock-step, fewer options) under QWENSERVE_RUN_BENCHMARKS=1."""
    if arch == "qwen3":
        target, aux = tiny_model("qwen3", num_hidden_layers=4), None
    else:
        target, aux = tiny_model("qwen3_moe"), [0, 1, 2]
    head = make_eagle3_head(target, str(tmp_path_factory.mktemp(f"eagle3-tp-{arch}")),
                            aux_layer_ids=aux, norm_before_residual=arch == "qwen3_moe")
    run_tp2(target, {"method": "eagle3", "model": head, "num_speculative_tokens": K})


@pytest.mark.parametrize("draft_tp", [None, 1])
def test_draft_model_on_hybrid(tiny_model, draft_tp):
    """Sharded like the target (vLLM's default), or whole on the driver rank only."""
    spec = {"method": "draft_model", "model": tiny_model("qwen3", seed=1),
            "num_speculative_tokens": K}
    if draft_tp is not None:
        spec["draft_tensor_parallel_size"] = draft_tp
    run_tp2(tiny_model("qwen3_5"), spec)


def test_ngram_on_hybrid(tiny_model):
    run_tp2(tiny_model("qwen3_5"), {"method": "ngram", "num_speculative_tokens": K,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 2})


def test_rigged_mtp_accepts_at_tp2(tiny_model, monkeypatch, tmp_path):
    """The head runs on both ranks; both propose the target's own continuation: acceptance
    near 100%, output still identical, the per-position counts filled."""
    path = add_mtp_head(tiny_model("qwen3_5", mtp_num_hidden_layers=1))
    llm = spec_llm(path)
    longer = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K + 1, ignore_eos=True)
    continuations = ids(gen(llm, longer, PROMPTS))
    llm.llm_engine.shutdown()
    rig_every_rank(monkeypatch, tmp_path, PROMPTS, continuations)
    spec = {"method": "qwen3_5_mtp", "num_speculative_tokens": K}
    drafts, draft_tokens, accepted = run_tp2(path, spec, per_pos=True)
    assert accepted / draft_tokens > 0.95


def test_draft_tensor_parallel_size_refusals(tiny_model):
    path = add_mtp_head(tiny_model("qwen3_5", mtp_num_hidden_layers=1))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=3: use 1 or"):
        spec_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           "draft_tensor_parallel_size": 3})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=1 with method mtp"):
        spec_llm(path, tensor_parallel_size=2, speculative_config={
            "method": "qwen3_5_mtp", "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 1})
