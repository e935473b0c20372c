"""MTP speculative decoding with data parallelism, on real processes: a tiny Qwen3.5-MoE with an
``mtp.*`` head (hybrid: its Gated DeltaNet states roll back on rejected drafts) served with
``--data-parallel-size 2 --enable-expert-parallel --speculative-config qwen3_5_mtp`` as vLLM
Ascend's guides run it (also with ``--tensor-parallel-size 2``), and with plain
``--data-parallel-size 2``.

With DP x EP the replicas form one MoE group, the MTP head's MoE layer included, so every replica
must run the same MoE passes each step: target, rollback recompute, k head passes
(``worker/dp_passes.py``). The loads here are unequal on purpose (different lengths, one replica
idle while the other drafts and rolls back): a replica running a pass the other skips would hang
in the collective, which the requests' timeouts turn into a failure. Greedy output must equal one
engine's without speculation."""

from __future__ import annotations

import json

import pytest

from helpers.dp_serving import (
    complete_at_once,
    dp_server,
    one_engine_reference,
    per_engine,
    stop_cleanly,
)
from helpers.tiny_models import add_mtp_head

# disable_by_batch_size 2: a replica with 2 requests drafts nothing while one with 1 drafts, so
# the replicas' speculation on/off decisions can differ in a step (none is agreed)
SPEC = {"method": "qwen3_5_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 2}
ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "16M",
        "--max-num-batched-tokens", "32", "--data-parallel-size", "2",
        "--speculative-config", json.dumps(SPEC)]
PROMPTS = [[5, 17, 99, 3], list(range(10, 50)), [7, 300, 12, 7, 300, 12], [42] * 9]
MAX_TOKENS = [14, 3, 9, 1]  # replicas finish at different steps: one idles, one drafts


@pytest.fixture(scope="module")
def moe_mtp_path(tiny_model) -> str:
    return add_mtp_head(tiny_model("qwen3_5_moe", mtp_num_hidden_layers=1))


@pytest.fixture(scope="module")
def reference(moe_mtp_path) -> list[str]:
    """One engine, no speculation: the prompts, then PROMPTS[0] again alone (6 tokens)."""
    return one_engine_reference(moe_mtp_path, [*PROMPTS, PROMPTS[0]], [*MAX_TOKENS, 6], 128)


# dp_ep_tp2 runs every mechanism here (one MoE group over the replicas, the padded passes, the
# head sharded) and is the only DP x TP case: CI runs it alone. dp_ep (the same at TP 1) and dp
# (replicas that never meet: speculation per engine is test_server_spec_decode.py's, DP routing
# test_data_parallel.py's) each start 3 more processes: under QWENSERVE_RUN_BENCHMARKS=1.
@pytest.mark.parametrize("extra", [
    pytest.param(["--enable-expert-parallel"], id="dp_ep", marks=pytest.mark.benchmark),
    pytest.param([], id="dp", marks=pytest.mark.benchmark),
    pytest.param(["--enable-expert-parallel", "--tensor-parallel-size", "2"], id="dp_ep_tp2")])
def test_mtp_with_data_parallelism_equals_one_engine(moe_mtp_path, reference, tmp_path, extra):
    """dp_ep_tp2: 2 replicas x 2 tensor-parallel ranks, the head sharded on both ranks of each
    replica, its experts over all 4."""
    server = dp_server(moe_mtp_path, [*ARGS, *extra], tmp_path / "serve.log")
    try:
        # the prompts at once (both replicas busy, then one), then one alone (the other idles)
        served = [*complete_at_once(server, PROMPTS, MAX_TOKENS),
                  *complete_at_once(server, [PROMPTS[0]], [6])]
        assert served == reference
        done = per_engine(server, "vllm:request_success_total")
        drafts = per_engine(server, "vllm:spec_decode_num_drafts_total")
        assert set(done) == {"0", "1"} and all(done.values()), done  # both replicas served
        assert sum(drafts.values()) > 0, drafts
    finally:
        stop_cleanly(server)
