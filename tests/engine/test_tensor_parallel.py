"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1, multi-node rendezvous from the
environment, and a dead worker stops the engine with the rank's name instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.ports import free_port
from qwenserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [7, 300, 12], [42] * 20]
HERE = os.path.dirname(os.path.abspath(__file__))


def greedy_tokens(path: str, tp: int, **kw) -> list[list[int]]:
    """Greedy tokens of PROMPTS, then of the same prompts again (prefix-cache hits; on hybrid
    models restored state checkpoints): both rounds must agree."""
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=tp, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rounds = [[o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)] for _ in range(2)]
    assert llm.llm_engine.cache.stats.hits > 0
    llm.llm_engine.shutdown()
    assert rounds[0] == rounds[1]
    return rounds[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
                                  "qwen3_next"])
def test_tp2_equals_tp1_with_chunked_prefill(tiny_model, arch):
    path = tiny_model(arch)
    assert greedy_tokens(path, 2) == greedy_tokens(path, 1)


def test_tp2_with_ngram_speculation(tiny_model):
    """Drafts reach every rank in the scheduler output; greedy output is unchanged."""
    path = tiny_model("qwen2")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    assert greedy_tokens(path, 2, speculative_config=spec) == greedy_tokens(path, 1)


def test_heads_must_divide(tiny_model):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(tiny_model("qwen2"), dtype="float32", tensor_parallel_size=3)



def _script(body: str) -> str:
    header = "import json, sys\nfrom qwenserve import LLM, SamplingParams\n"
    return header + textwrap.dedent(body)


def test_two_nodes_on_localhost(tiny_model):
    path = tiny_model("qwen2")
    env = dict(os.environ, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    make = f"LLM({path!r}, dtype='float32', max_model_len=256, max_num_batched_tokens=16, " \
           "tensor_parallel_size=2)"
    driver = _script(f"""
        llm = {make}
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        print(json.dumps([o.outputs[0].token_ids for o in outs]))
    """)
    node1 = subprocess.Popen([sys.executable, "-c", _script(make)],
                             env=dict(env, NODE_RANK="1"), stderr=subprocess.PIPE, text=True)
    node0 = subprocess.run([sys.executable, "-c", driver], env=dict(env, NODE_RANK="0"),
                           capture_output=True, text=True, timeout=300)
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert node1.wait(timeout=60) == 0, node1.stderr.read()[-2000:]
    assert json.loads(node0.stdout.strip().splitlines()[-1]) == greedy_tokens(path, 1)


def test_killed_worker_stops_the_engine_with_its_rank(tiny_model):
    path = tiny_model("qwen2")
    body = f"""
        import time
        llm = LLM({path!r}, dtype='float32', max_model_len=256, tensor_parallel_size=2)
        print("PID", llm.llm_engine.executor.procs[1].pid, flush=True)
        while True:
            llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=8))
    """
    proc = subprocess.Popen([sys.executable, "-c", _script(body)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PID"), proc.stderr.read()[-2000:]
    os.kill(int(line.split()[1]), 9)
    killed_at = time.monotonic()
    code = proc.wait(timeout=30)
    stderr = proc.stderr.read()
    assert code != 0 and time.monotonic() - killed_at < 10
    assert "worker rank 1" in stderr and "died" in stderr
