"""Flags of ``qwenserve bench serve``: vLLM's names and defaults, then our additions.

Scripts written for ``vllm bench serve`` must run unchanged, so every vLLM flag we support keeps its
spelling and default; where vLLM accepts two spellings (``prefix_repetition``), so do we.
"""

from __future__ import annotations

import argparse
import json

from qwenserve.tools.bench.client import BACKEND_SUFFIXES
from qwenserve.tools.bench.datasets import DatasetSpec


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """All flags, grouped as in ``--help``."""
    _add_target(parser.add_argument_group("server"))
    _add_dataset(parser.add_argument_group("dataset"))
    _add_traffic(parser.add_argument_group("traffic"))
    _add_sampling(parser.add_argument_group("sampling parameters (sent only when given)"))
    _add_output(parser.add_argument_group("results"))
    _add_sweep(parser.add_argument_group("sweep, plot and report (qwenserve additions)"))


def _add_target(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--backend",
        default="openai",
        choices=sorted(BACKEND_SUFFIXES),
        help="openai/vllm: /v1/completions; openai-chat: /v1/chat/completions",
    )
    g.add_argument("--base-url", default=None, help="server URL; else http://HOST:PORT")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--endpoint",
        default=None,
        help="API path (default: /v1/completions, or /v1/chat/completions for openai-chat)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="model name sent in requests; default: the first of GET /v1/models",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="name sent in requests when it differs from --model",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer (folder or id) for client-side counts; default: "
        "--model when it is a local folder, else the server's /tokenize",
    )
    g.add_argument(
        "--tokenizer-mode",
        default="auto",
        choices=["auto", "hf", "slow"],
        help="auto/hf: the fast tokenizer when there is one; slow: the Python one",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run a tokenizer's own code (local tokenizers only)",
    )
    g.add_argument("--api-key", default=None, help="bearer token; default: $OPENAI_API_KEY")
    g.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="wait up to this long for the server to come up (0: fail at once, as vLLM)",
    )
    g.add_argument(
        "--header",
        nargs="*",
        metavar="KEY=VALUE",
        default=None,
        help="extra HTTP headers for every request",
    )
    g.add_argument(
        "--request-id-prefix",
        default=None,
        help="x-request-id header prefix (default: bench-<8 random hex>-)",
    )


def _add_dataset(g: argparse._ArgumentGroup) -> None:
    d = DatasetSpec()
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=["sharegpt", "random", "prefix-repetition", "prefix_repetition"],
    )
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=d.num_prompts,
        help="measured requests (warm-up requests come on top)",
    )
    g.add_argument("--input-len", type=int, default=None, help="alias of --random-input-len")
    g.add_argument(
        "--output-len", type=int, default=None, help="sets the output length of every dataset"
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="override ShareGPT's reference completion lengths",
    )
    g.add_argument("--random-input-len", type=int, default=d.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d.random_output_len)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths uniform in [L*(1-r), L*(1+r)]",
    )
    g.add_argument(
        "--random-prefix-len",
        type=int,
        default=d.random_prefix_len,
        help="tokens of one random prefix shared by all random prompts",
    )
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=d.prefix_len)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=d.suffix_len)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=d.num_prefixes)
    g.add_argument("--prefix-repetition-output-len", type=int, default=d.prefix_output_len)
    g.add_argument("--disable-shuffle", action="store_true", help="keep the file's order")
    g.add_argument(
        "--no-oversample",
        action="store_true",
        help="do not repeat prompts when the file has fewer than --num-prompts",
    )
    g.add_argument("--seed", type=int, default=0)


def _add_traffic(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s (Poisson, or gamma with --burstiness); inf sends all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more even",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument(
        "--warmup-requests",
        "--num-warmups",
        dest="warmup_requests",
        type=int,
        default=20,
        help="requests sent before the measured window, excluded from every figure (default 20)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (always on for the random dataset, as in vLLM)",
    )
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON merged into every request body, e.g. '{\"top_k\": 1}'",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_sampling(g: argparse._ArgumentGroup) -> None:
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("frequency-penalty", float), ("presence-penalty", float),
                       ("repetition-penalty", float)):  # fmt: skip
        g.add_argument(f"--{name}", type=kind, default=None)


def _add_output(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="metrics printed with percentiles (ttft,tpot,itl,e2el); the JSON always has all four",
    )
    g.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="also save the per-request lists (input_lens, output_lens, start_times, ttfts, "
        "itls, generated_texts, errors), as in vLLM",
    )
    g.add_argument("--result-dir", default=None, help="folder for JSON, PNG and Markdown files")
    g.add_argument("--result-filename", default=None, help="name of the result JSON")
    g.add_argument("--label", default=None, help="result file prefix (default: --backend)")
    g.add_argument(
        "--metadata",
        nargs="*",
        metavar="KEY=VALUE",
        default=None,
        help="extra keys recorded in the result JSON",
    )


def _add_sweep(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--sweep",
        default=None,
        metavar="KIND=V1,V2,...",
        help="one measured run per load point: request-rate=1,2,4,inf or max-concurrency=1,4,16",
    )
    g.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="write a PNG (load curves for a sweep, timeline for one run)",
    )
    g.add_argument(
        "--report", nargs="?", const="", default=None, metavar="MD", help="write a Markdown summary"
    )
    g.add_argument(
        "--knee-throughput-frac",
        type=float,
        default=0.9,
        help="knee: output throughput at least this fraction of the sweep's best",
    )
    g.add_argument(
        "--knee-latency-factor",
        type=float,
        default=3.0,
        help="knee: median TTFT and TPOT at most this multiple of the lowest load's",
    )


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """``["a=1", "b=2"]`` -> ``{"a": "1", "b": "2"}``; anything without ``=`` is an error."""
    pairs: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs
