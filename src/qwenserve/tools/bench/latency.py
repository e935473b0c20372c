"""``qwenserve bench latency``: how long one batch takes from prompt to last token, offline.

vLLM's ``vllm bench latency``: ``--batch-size`` random prompts of ``--input-len`` tokens, each
generating exactly ``--output-len`` tokens (``ignore_eos``), run ``--num-iters-warmup`` times
unmeasured and ``--num-iters`` times measured. Prefix caching defaults to off here, as in vLLM,
because repeating the same batch would otherwise measure cache hits instead of prefill.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.offline import add_engine_arguments, check_fits, make_llm

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="unmeasured iterations")
    g.add_argument("--num-iters", type=int, default=30, help="measured iterations")
    g.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="leave detokenisation out of the measurement",
    )
    g.add_argument("--output-json", default=None, help="write the results here")
    add_engine_arguments(parser, enable_prefix_caching=False)


def dummy_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    """Random token prompts; vLLM draws ids below 10000, capped here by the vocabulary."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(min(10000, vocab_size), size=(batch_size, input_len))
    return [{"prompt_token_ids": row} for row in ids.tolist()]


def run(args: argparse.Namespace) -> int:
    if min(args.input_len, args.output_len, args.batch_size, args.n, args.num_iters) < 1:
        raise BenchError(
            "--input-len, --output-len, --batch-size, --n and --num-iters must be >= 1"
        )
    from qwenserve import SamplingParams

    llm = make_llm(args)
    check_fits(llm, args.input_len + args.output_len)
    params = SamplingParams(
        n=args.n,
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=args.output_len,
        detokenize=not args.disable_detokenize,
    )
    vocab_size = int(llm.get_tokenizer().vocab_size)
    prompts = dummy_prompts(args.batch_size, args.input_len, vocab_size, args.seed)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        once()
    latencies = np.array([once() for _ in tqdm(range(args.num_iters), desc="Bench iterations")])
    results = summarize(latencies)
    print(f"Avg latency: {results['avg_latency']} seconds")
    print(f"Std latency: {results['std_latency']} seconds")
    for pct, value in results["percentiles"].items():
        print(f"{pct}% percentile latency: {value} seconds")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=4)
    return 0


def summarize(latencies: np.ndarray) -> dict[str, Any]:
    """vLLM's result keys: mean, population std, all latencies and fixed percentiles."""
    return {
        "avg_latency": float(np.mean(latencies)),
        "std_latency": float(np.std(latencies)),
        "latencies": latencies.tolist(),
        "percentiles": dict(
            zip(PERCENTAGES, np.percentile(latencies, PERCENTAGES).tolist(), strict=True)
        ),
    }
