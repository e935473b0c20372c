"""``qwenserve bench serve``: load an OpenAI-compatible server and report vLLM's figures.

The order of work is chosen so that every mistake in the input is reported before any load:
flags, then the dataset file, then the server (reachable? key accepted? model served?), then the
prompts (which may need the server's tokenizer). Only then warm-up and the measured run(s).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from qwenserve import __version__, envs
from qwenserve.tools.bench.client import BACKEND_SUFFIXES, DEFAULT_ENDPOINTS
from qwenserve.tools.bench.datasets import (
    DatasetSpec,
    SampleRequest,
    build_workload,
    check_spec,
    normalize_name,
)
from qwenserve.tools.bench.errors import BenchError
from qwenserve.tools.bench.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    queue_stats,
)
from qwenserve.tools.bench.probe import ServerInfo, probe_server
from qwenserve.tools.bench.results import (
    RunInfo,
    build_result,
    count_output_tokens,
    format_console,
    result_filename,
    saved_form,
    write_json,
)
from qwenserve.tools.bench.runner import LoadSpec, Target, run_load
from qwenserve.tools.bench.serve_args import parse_key_values
from qwenserve.tools.bench.tokenizer import (
    HFTokenizer,
    ServerTokenizer,
    TokenizerLike,
    local_tokenizer_path,
)


@dataclass(frozen=True)
class ServeConfig:
    """Validated settings of one ``bench serve`` run (from flags only, nothing from the server)."""

    base_url: str
    api_url: str
    backend: str
    headers: dict[str, str]
    extra_body: dict[str, Any]
    dataset: DatasetSpec
    load: LoadSpec
    warmup_requests: int
    ignore_eos: bool
    logprobs: int | None
    percentiles: list[float]
    selected_metrics: list[str]
    goodput_ms: dict[str, float]
    metadata: dict[str, str]
    show_progress: bool


def build_config(args: argparse.Namespace) -> ServeConfig:
    """Check every flag that can be checked without the server; raise ``BenchError`` if wrong."""
    try:
        return _build_config(args)
    except ValueError as e:
        raise BenchError(str(e)) from e


def _build_config(args: argparse.Namespace) -> ServeConfig:
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if not args.request_rate > 0:  # also rejects nan
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0 (or inf), got {args.burstiness}")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    if not endpoint.endswith(BACKEND_SUFFIXES[args.backend]):
        raise ValueError(
            f"--backend {args.backend} needs an endpoint ending in "
            f"{BACKEND_SUFFIXES[args.backend]!r}, got --endpoint {endpoint}"
        )
    dataset = _dataset_spec(args)
    return ServeConfig(
        base_url=base_url,
        api_url=f"{base_url}{endpoint}",
        backend=args.backend,
        headers=_headers(args),
        extra_body={**_sampling_body(args), **(args.extra_body or {})},
        dataset=dataset,
        load=LoadSpec(args.request_rate, args.burstiness, args.max_concurrency),
        warmup_requests=args.warmup_requests,
        # vLLM turns ignore_eos on for the random dataset so outputs reach the asked length.
        ignore_eos=args.ignore_eos or dataset.name == "random",
        logprobs=args.logprobs,
        percentiles=parse_percentiles(args.metric_percentiles),
        selected_metrics=parse_metric_names(args.percentile_metrics),
        goodput_ms=parse_goodput(args.goodput),
        metadata=parse_key_values(args.metadata, "--metadata"),
        show_progress=not args.disable_tqdm,
    )


def _dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    out_len = args.output_len
    return DatasetSpec(
        name=normalize_name(args.dataset_name),
        path=args.dataset_path,
        num_prompts=args.num_prompts,
        seed=args.seed,
        disable_shuffle=args.disable_shuffle,
        no_oversample=args.no_oversample,
        request_id_prefix=args.request_id_prefix or f"bench-{uuid.uuid4().hex[:8]}-",
        sharegpt_output_len=out_len if out_len is not None else args.sharegpt_output_len,
        random_input_len=args.input_len if args.input_len is not None else args.random_input_len,
        random_output_len=out_len if out_len is not None else args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        prefix_len=args.prefix_repetition_prefix_len,
        suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_output_len=out_len if out_len is not None else args.prefix_repetition_output_len,
    )


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    api_key = args.api_key or envs.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers.update(parse_key_values(args.header, "--header"))
    return headers


def _sampling_body(args: argparse.Namespace) -> dict[str, Any]:
    names = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty")  # fmt: skip
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


@dataclass
class Session:
    """What a run needs once the server and the prompts are known."""

    config: ServeConfig
    target: Target
    model_id: str
    tokenizer: TokenizerLike
    measured: list[SampleRequest]
    warmup: list[SampleRequest]
    label: str | None
    sharegpt_entries: list[dict[str, Any]] | None


def prepare(args: argparse.Namespace, config: ServeConfig) -> Session:
    """Dataset file, server probe, tokenizer and prompts: everything before the first request."""
    entries = check_spec(config.dataset)
    model = args.served_model_name or args.model
    server = probe_server(config.base_url, model, config.headers,
                          ready_timeout_s=args.ready_check_timeout_sec)  # fmt: skip
    tokenizer = open_tokenizer(args, config, server)
    print(f"Preparing {config.dataset.num_prompts} {config.dataset.name} prompts "
          f"(tokenizer: {tokenizer.name}) ...")  # fmt: skip
    measured, warmup = build_workload(config.dataset, tokenizer, config.warmup_requests, entries)
    target = Target(
        api_url=config.api_url,
        model=server.model,
        chat=config.backend == "openai-chat",
        ignore_eos=config.ignore_eos,
        logprobs=config.logprobs,
        headers=config.headers,
        extra_body=config.extra_body,
    )
    # vLLM: without --model the model id (and so the result name) is the served model's root
    model_id = args.model or server.root or server.model
    return Session(config, target, model_id, tokenizer, measured, warmup, args.label, entries)


def open_tokenizer(
    args: argparse.Namespace, config: ServeConfig, server: ServerInfo
) -> TokenizerLike:
    """A local tokenizer when one is named or the model is a local folder, else the server's."""
    path = local_tokenizer_path(args.tokenizer, args.model, server.root)
    if path is not None:
        return HFTokenizer.load(path, args.tokenizer_mode, args.trust_remote_code)
    return ServerTokenizer(config.base_url, server.model, config.headers)


def measure(session: Session, load: LoadSpec, measured: list[SampleRequest]) -> dict[str, Any]:
    """One warm-up plus measured run at ``load``; prints vLLM's block, returns the result dict."""
    cfg = session.config
    print(f"Warm-up: {len(session.warmup)} requests; then {len(measured)} measured requests at "
          f"{load.label()}, burstiness {load.burstiness:g}")  # fmt: skip
    run = asyncio.run(run_load(session.target, measured, session.warmup, load, cfg.dataset.seed,
                               cfg.show_progress))  # fmt: skip
    output_lens, source = count_output_tokens(run.results, session.tokenizer)
    metrics = calculate_metrics(run.results, output_lens, run.duration_s, cfg.percentiles,
                                cfg.goodput_ms)  # fmt: skip
    if load.max_concurrency is not None:
        queued = queue_stats(run.results, cfg.percentiles, not math.isinf(load.request_rate))
        metrics = replace(metrics, stats={**metrics.stats, **queued})
    print(format_console(metrics, run.duration_s, (load.request_rate, load.max_concurrency),
                         cfg.selected_metrics, bool(cfg.goodput_ms)))  # fmt: skip
    first_error = next((r.error for r in run.results if not r.success), "")
    if first_error:
        print(f"First error ({metrics.failed} failed): {first_error}")
    warm_lens, _ = count_output_tokens(run.warmup, session.tokenizer)
    info = RunInfo(
        backend=cfg.backend, label=session.label, model_id=session.model_id,
        tokenizer_id=session.tokenizer.name, num_prompts=cfg.dataset.num_prompts,
        request_rate=load.request_rate, burstiness=load.burstiness,
        max_concurrency=load.max_concurrency, dataset_name=cfg.dataset.name,
        seed=cfg.dataset.seed, goodput_ms=cfg.goodput_ms,
    )  # fmt: skip
    extra = {
        "output_token_source": source,
        "first_error": first_error or None,
        "goodput_slos_ms": cfg.goodput_ms or None,
        "warmup_requests": len(run.warmup),
        "warmup_failed": sum(not r.success for r in run.warmup),
        "warmup_input_tokens": sum(r.prompt_len for r in run.warmup if r.success),
        "warmup_output_tokens": sum(warm_lens),
        "qwenserve_version": __version__,
        **cfg.metadata,
    }
    return build_result(info, metrics, run.results, output_lens, run.duration_s, extra)


def output_path(args: argparse.Namespace, name: str) -> str:
    return os.path.join(args.result_dir, name) if args.result_dir else name


def run_single(args: argparse.Namespace, session: Session) -> int:
    """One measured run; then the JSON, the plot and the report that were asked for."""
    load = session.config.load
    result = measure(session, load, session.measured)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    json_name = args.result_filename or result_filename(
        session.label, args.backend, (load.request_rate, load.max_concurrency),
        session.model_id, stamp,
    )  # fmt: skip
    base = output_path(args, os.path.splitext(json_name)[0])
    if args.save_result:
        write_json(output_path(args, json_name), saved_form(result, args.save_detailed))
        print(f"Result saved to {output_path(args, json_name)}")
    plot_path = None
    if args.plot is not None:
        from qwenserve.tools.bench.plots import plot_run

        plot_path = args.plot or f"{base}.png"
        plot_run(result, plot_path)
        print(f"Plot saved to {plot_path}")
    if args.report is not None:
        from qwenserve.tools.bench.report import run_report

        path = args.report or f"{base}.md"
        write_text(path, run_report(result, session.config.percentiles, plot_path, path))
        print(f"Report saved to {path}")
    return 0


def write_text(path: str, text: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``bench serve``; ``BenchError`` is turned into a message by ``cli.run``."""
    config = build_config(args)
    sweep = None
    if args.sweep:
        from qwenserve.tools.bench.sweep import check_knee_flags, parse_sweep

        sweep = parse_sweep(args.sweep)
        check_knee_flags(args.knee_throughput_frac, args.knee_latency_factor)
    session = prepare(args, config)
    try:
        if sweep is None:
            return run_single(args, session)
        from qwenserve.tools.bench.sweep import run_sweep

        return run_sweep(args, session, sweep)
    finally:
        close = getattr(session.tokenizer, "close", None)
        if close is not None:
            close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``bench serve``'s flags (see ``serve_args``)."""
    from qwenserve.tools.bench.serve_args import add_serve_arguments

    add_serve_arguments(parser)


run = run_serve
