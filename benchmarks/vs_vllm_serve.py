"""Served / offline, in one run with the same engine flags: `qwenserve serve` under
`qwenserve bench serve`, against `qwenserve bench throughput` (offline `LLM.generate`) on the same
random workload; and the same for vLLM when a vLLM CPU environment is given.

    python benchmarks/vs_vllm_serve.py                               # embedded SmolLM2-135M
    python benchmarks/vs_vllm_serve.py --shape qwen2.5-0.5b --dtype bfloat16 --rates inf,5
    python benchmarks/vs_vllm_serve.py --topologies process,thread   # engine process vs thread
    python benchmarks/vs_vllm_serve.py --topologies process,dp2      # 1 vs 2 data-parallel engines
    python benchmarks/vs_vllm_serve.py --vllm-python /work/venvs/vllm/bin/python

Each server is started, driven at each request rate (random dataset, ``--ignore-eos``,
temperature 1 as ``bench throughput`` samples), and stopped before the next side runs, so one
machine's cores serve one side at a time. The client runs on the same machine as the server.
vLLM is driven by its own ``vllm bench serve`` through ``../shared/tools/vllm_cli.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_CLI = os.path.join(HERE, "..", "..", "shared", "tools", "vllm_cli.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: argparse.Namespace, model: str) -> list[str]:
    flags = ["--max-model-len", str(args.max_model_len), "--seed", "0",
             "--max-num-seqs", str(args.max_num_seqs)]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    return ([model] if model else []) + flags


def workload_flags(args: argparse.Namespace) -> list[str]:
    return ["--dataset-name", "random", "--num-prompts", str(args.num_prompts)]


def offline(args: argparse.Namespace, model: str, env: dict[str, str]) -> float:
    """``qwenserve bench throughput``: output tokens/s of one ``LLM.generate`` call."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "offline.json")
        cmd = [sys.executable, "-m", "qwenserve.entrypoints.cli", "bench", "throughput",
               *workload_flags(args), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--output-json", out,
               *(["--model", model] if model else []), *engine_flags(args, "")]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return float(json.load(f)["output_tokens_per_second"])


def start_server(cmd: list[str], env: dict[str, str], port: int, log: str) -> subprocess.Popen:
    import httpx

    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)  # --log-dir may be new
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"server not ready; see {log}")


def drive(client: list[str], args: argparse.Namespace, port: int, rate: str,
          env: dict[str, str]) -> dict:
    """One ``bench serve`` run; its saved JSON (vLLM's keys)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*client, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               *workload_flags(args), "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--ignore-eos",
               "--request-rate", rate, "--temperature", "1.0", "--top-p", "1.0",
               "--save-result", "--result-dir", tmp, "--result-filename", "r.json",
               "--disable-tqdm", "--seed", "0"]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(os.path.join(tmp, "r.json")) as f:
            return json.load(f)


def served(args: argparse.Namespace, model: str, topology: str, env: dict[str, str],
           log_dir: str) -> dict[str, dict]:
    port = free_port()
    dp = int(topology[2:]) if topology.startswith("dp") else 1  # "dp2": two engine processes
    env = dict(env, QWENSERVE_ENABLE_MULTIPROCESSING="0" if topology == "thread" else "1")
    cmd = [sys.executable, "-m", "qwenserve.entrypoints.cli", "serve", *engine_flags(args, model),
           *(["--data-parallel-size", str(dp)] if dp > 1 else []),
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
           *([] if args.log_requests else ["--disable-log-requests"])]
    proc = start_server(cmd, env, port, os.path.join(log_dir, f"qwenserve-{topology}.log"))
    client = [sys.executable, "-m", "qwenserve.entrypoints.cli"]
    try:
        if args.warmup_prompts:  # first-seen batch shapes are slow on CPU
            warm = argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_prompts})
            drive(client, warm, port, "inf", env)
        return {rate: drive(client, args, port, rate, env) for rate in args.rates}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def vllm_side(args: argparse.Namespace, model: str, env: dict[str, str],
              log_dir: str) -> tuple[float, dict[str, dict]]:
    py = args.vllm_python
    venv_env = dict(env, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4")
    port = free_port()
    cmd = [py, VLLM_CLI, "serve", model, *engine_flags(args, ""), "--host", "127.0.0.1",
           "--port", str(port), "--disable-log-requests"]
    proc = start_server(cmd, venv_env, port, os.path.join(log_dir, "vllm.log"))
    try:
        runs = {rate: drive([py, VLLM_CLI], args, port, rate, venv_env) for rate in args.rates}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    out = subprocess.run([py, VLLM_CLI, "bench", "throughput", "--model", model,
                          *workload_flags(args), "--input-len", str(args.input_len),
                          "--output-len", str(args.output_len), *engine_flags(args, "")],
                         env=venv_env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("Throughput:"))
    # "Throughput: R requests/s, T total tokens/s, O output tokens/s"
    return float(line.split(",")[2].split()[0]), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--shape", default=None, help="a random-weight shape of common.SHAPES")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--warmup-prompts", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rates", default="inf", help="comma-separated request rates")
    parser.add_argument("--topologies", default="process",
                        help="process, thread and/or dpN (N data-parallel engine processes)")
    parser.add_argument("--log-requests", action="store_true", help="keep request logs on")
    parser.add_argument("--vllm-python", default=None, help="a vLLM CPU venv's python")
    parser.add_argument("--log-dir", default=tempfile.mkdtemp(prefix="vs-vllm-serve-"))
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    model = args.model or ""
    if args.shape:
        sys.path.insert(0, HERE)
        from common import shaped_model

        model = shaped_model(args.shape)
    env = dict(os.environ)
    rows = {"offline": offline(args, model, env)}
    result: dict = {"config": {k: v for k, v in vars(args).items()}, "qwenserve": rows}
    for topology in args.topologies.split(","):
        for rate, run in served(args, model, topology, env, args.log_dir).items():
            rows[f"{topology} rate {rate}"] = {
                "output_tok_s": run["output_throughput"],
                "median_ttft_ms": run["median_ttft_ms"], "median_tpot_ms": run["median_tpot_ms"],
                "served_over_offline": run["output_throughput"] / rows["offline"]}
    if args.vllm_python:
        vllm_offline, runs = vllm_side(args, model, env, args.log_dir)
        result["vllm"] = {"offline": vllm_offline, **{
            f"rate {rate}": {"output_tok_s": r["output_throughput"],
                             "median_ttft_ms": r["median_ttft_ms"],
                             "median_tpot_ms": r["median_tpot_ms"],
                             "served_over_offline": r["output_throughput"] / vllm_offline}
            for rate, r in runs.items()}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
