"""``qwenserve bench throughput``: offline throughput with the engine in-process.

Same workload and arithmetic as ``vllm bench throughput``: all prompts are handed to
``LLM.generate`` at once with ``temperature=1.0, top_p=1.0, ignore_eos=True`` and each request's
expected output length, and throughput divides the token counts the engine actually produced by the
wall time of that one call. The printed lines and JSON keys are vLLM's.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from qwenserve.tools.bench.datasets import DatasetSpec, build_workload, check_spec, normalize_name
from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.offline import add_engine_arguments, check_fits, make_llm
from qwenserve.tools.bench.tokenizer import HFTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DatasetSpec()
    g = parser.add_argument_group("benchmark")
    g.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm"],
        help="accepted for vLLM compatibility: the in-process engine",
    )
    g.add_argument(
        "--dataset-name",
        default=None,
        choices=["sharegpt", "random", "prefix-repetition", "prefix_repetition"],
        help="default: sharegpt with --dataset-path, else random",
    )
    g.add_argument("--dataset-path", "--dataset", dest="dataset_path", default=None)
    g.add_argument("--input-len", type=int, default=None, help="random prompt length (1024)")
    g.add_argument("--output-len", type=int, default=None, help="output length of every request")
    g.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio)
    g.add_argument(
        "--prefix-len",
        type=int,
        default=d.random_prefix_len,
        help="shared random prefix of the random dataset",
    )
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=d.prefix_len)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=d.suffix_len)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=d.num_prefixes)
    g.add_argument("--prefix-repetition-output-len", type=int, default=d.prefix_output_len)
    g.add_argument("--disable-shuffle", action="store_true")
    g.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="leave detokenisation out of the measurement",
    )
    g.add_argument("--output-json", default=None, help="write the results here")
    add_engine_arguments(parser)


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """vLLM's mapping of the generic flags onto each dataset."""
    name = normalize_name(args.dataset_name or ("sharegpt" if args.dataset_path else "random"))
    d = DatasetSpec()
    out = args.output_len
    return DatasetSpec(
        name=name, path=args.dataset_path, num_prompts=args.num_prompts, seed=args.seed,
        disable_shuffle=args.disable_shuffle, sharegpt_output_len=out,
        random_input_len=args.input_len or d.random_input_len,
        random_output_len=out or d.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.prefix_len, prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_output_len=out or args.prefix_repetition_output_len,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    spec = dataset_spec(args)
    entries = check_spec(spec)
    if args.n < 1:
        raise BenchError(f"--n must be >= 1, got {args.n}")
    llm = make_llm(args)
    tokenizer = HFTokenizer(llm.get_tokenizer(), args.tokenizer or args.model or "model")
    requests, _ = build_workload(spec, tokenizer, 0, entries)
    check_fits(llm, max(r.prompt_len + r.expected_output_len for r in requests))
    elapsed_s, outputs = generate(llm, requests, args.n, args.disable_detokenize)
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    results = summarize(elapsed_s, len(requests), prompt_tokens, output_tokens)
    print(f"Throughput: {results['requests_per_second']:.2f} requests/s, "
          f"{results['tokens_per_second']:.2f} total tokens/s, "
          f"{results['output_tokens_per_second']:.2f} output tokens/s")  # fmt: skip
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=4)
    return 0


def generate(llm: Any, requests: list, n: int, disable_detokenize: bool) -> tuple[float, list]:
    """One ``LLM.generate`` call over every prompt, timed (vLLM's ``run_vllm``)."""
    from qwenserve import SamplingParams

    prompts = [r.prompt for r in requests]
    params = [
        SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True,
                       max_tokens=r.expected_output_len, detokenize=not disable_detokenize)
        for r in requests
    ]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    return time.perf_counter() - start, list(outputs)


def summarize(elapsed_s: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    """vLLM's result keys, plus the split of the token count."""
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed_s,
        "num_requests": num_requests,
        "total_num_tokens": total,
        "requests_per_second": num_requests / elapsed_s,
        "tokens_per_second": total / elapsed_s,
        "output_tokens_per_second": output_tokens / elapsed_s,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
    }
