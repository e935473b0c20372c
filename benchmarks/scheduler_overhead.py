"""What ``--async-scheduling`` could hide on this machine: the share of an engine step spent
outside the forward pass (scheduling, updates, detokenization), in a decode-heavy batch.

Async scheduling overlaps that host work of step N+1 with the device running step N; on CPU the
"device" is the same cores, so the bound is this share. Measured by timing ``LLMEngine.step``
and the executor's ``execute`` inside it.

    PYTHONPATH=src:tests python benchmarks/scheduler_overhead.py [--seqs 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    from helpers.tiny_models import make_tiny_model
    from qwenserve import LLM, SamplingParams

    path = make_tiny_model(args.arch, tempfile.mkdtemp() + "/m", hidden_size=args.hidden,
                           intermediate_size=3 * args.hidden, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=64, num_hidden_layers=8)
    llm = LLM(path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
    engine = llm.llm_engine
    inner = engine.executor.execute
    spent = {"execute": 0.0}

    def timed(sched):
        start = time.perf_counter()
        try:
            return inner(sched)
        finally:
            spent["execute"] += time.perf_counter() - start

    engine.executor.execute = timed
    params = SamplingParams(temperature=0.8, max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(str(i), [5 + i % 100, 17, 99, 3], params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    engine.shutdown()
    print(json.dumps({"steps": steps, "step_ms": round(1000 * total / steps, 2),
                      "host_ms_per_step": round(1000 * (total - spent["execute"]) / steps, 3),
                      "host_share": round((total - spent["execute"]) / total, 4),
                      "hidden_size": args.hidden}))


if __name__ == "__main__":
    main()
