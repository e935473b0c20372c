"""Data parallelism with expert parallelism on real processes (``--data-parallel-size 2
--enable-expert-parallel``): two engine-core replicas form one MoE group (each holds half the
experts) and step together, an idle replica running dummy steps. Greedy outputs equal one
device's, with requests on both replicas at once and with one replica idle.

The replicas run on a head and a ``--headless`` node (the group meets over TCP), the layout with
the most moving parts; two replicas under one server form the same group in
``test_data_parallel_spec.py`` (with speculation, at TP 2). One server for the module: starting
the processes is what costs time."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from helpers.dp_serving import complete_at_once, dp_server, one_engine_reference, per_engine
from helpers.ports import free_port_block

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16M",
        "--max-num-batched-tokens", "64", "--data-parallel-size", "2",
        "--enable-expert-parallel"]


@pytest.fixture(scope="module")
def moe_path(tiny_model) -> str:
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def head_and_node(moe_path, tmp_path_factory):
    """A head serving rank 0 and a headless node running rank 1; yields (head, node, node log).
    The node may start first: it waits for the head."""
    logs = tmp_path_factory.mktemp("dpep")
    # below the ephemeral range: the node, started first, retries connecting to the head's port,
    # and a retry to a loopback port in that range can connect to itself (source port = the
    # destination) and hold it when the head binds (seen in CI: "already in use")
    flags = [*ARGS, "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(free_port_block(1))]
    node_log = logs / "node.log"
    with open(node_log, "w") as log:
        node = subprocess.Popen([sys.executable, "-m", "qwenserve.entrypoints.cli", "serve",
                                 moe_path, *flags, "--headless", "--data-parallel-start-rank",
                                 "1"], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "QWENSERVE_LOGGING_LEVEL": "INFO"})
    try:
        head = dp_server(moe_path, flags, logs / "head.log")
        yield head, node, node_log
        head.stop()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_two_replicas_one_moe_group_equal_one_device(head_and_node, moe_path):
    head = head_and_node[0]
    assert "Data-parallel rank 1 joined" in head.log()
    pids = [c.pid for c in psutil.Process(head.proc.pid).children()
            if "qwenserve.engine.core_proc" in " ".join(c.cmdline())]
    assert len(pids) == 1  # the other replica runs under the node
    prompts = [[5, 17, 99, 3], list(range(10, 60)), [7, 300, 12], [42] * 9]
    max_tokens = [12, 3, 8, 1]  # replicas finish at different steps: one idles, one steps
    got = complete_at_once(head, prompts, max_tokens)
    lone = complete_at_once(head, [prompts[0]], [6])  # the other replica runs dummy steps
    want = one_engine_reference(moe_path, [*prompts, prompts[0]], [*max_tokens, 6], 256)
    assert [*got, *lone] == want
    done = per_engine(head, "vllm:request_success_total")
    assert set(done) == {"0", "1"} and all(done.values()), done  # both replicas served some


def test_stopping_the_head_stops_the_node(head_and_node):
    """Last in the module: SIGTERM to the head drains it, and the head tells the node's engine
    to stop, so the node exits cleanly too."""
    head, node, node_log = head_and_node
    assert head.stop() == 0, head.log()[-3000:]
    assert node.wait(timeout=60) == 0, node_log.read_text()[-3000:]
