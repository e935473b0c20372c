"""Start the server: bind, load the engine, serve with uvicorn, drain on SIGTERM/SIGINT.

    python -m qwenserve.entrypoints.openai.api_server --model MODEL [flags]   (vLLM's legacy form)
    qwenserve serve [MODEL] [flags]

The port is bound before the model loads, so a taken port fails in a second instead of after
the load. Start-up failures (bad model, unsupported option) print one ``ERROR`` line and exit 1;
``QWENSERVE_LOGGING_LEVEL=DEBUG`` adds the traceback. On SIGTERM or SIGINT the server stops
accepting connections, lets running requests finish for up to ``--shutdown-timeout`` seconds,
aborts the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

from qwenserve import envs
from qwenserve.entrypoints.openai.cli_args import ServeArgumentParser, make_serve_parser
from qwenserve.entrypoints.openai.cli_args import add_arguments as add_arguments
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

    from qwenserve.engine.arg_utils import EngineArgs
    from qwenserve.engine.async_engine import AsyncEngine
    from qwenserve.engine.core_client import CoreClient
    from qwenserve.entrypoints.openai.http_protocol import TimedH11Protocol
    from qwenserve.entrypoints.openai.serving_common import ServerState, ServingOptions

logger = init_logger("qwenserve.entrypoints.openai.api_server")


class _DeferredStatLogger:
    """Handed to the engine before the Prometheus logger exists (its token buckets need
    ``max_model_len``, which the engine resolves)."""

    def __init__(self) -> None:
        self.target: Any = None

    def record(self, stats: Any) -> None:
        if self.target is not None:
            self.target.record(stats)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def build_engine_args(args: argparse.Namespace) -> EngineArgs:
    from qwenserve.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag or args.model
    engine_args.usage_context = "server"
    return engine_args


def _options(args: argparse.Namespace, model_name: str) -> ServingOptions:
    from qwenserve.entrypoints.chat_utils import load_chat_template
    from qwenserve.entrypoints.openai.serving_common import ServingOptions
    from qwenserve.structured_output.config import parse_structured_outputs_config

    return ServingOptions(
        served_model_names=list(args.served_model_name or [model_name]),
        chat_template=load_chat_template(args.chat_template),
        response_role=args.response_role,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=dict(args.default_chat_template_kwargs or {}),
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=args.chat_template_content_format,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        log_requests=not args.disable_log_requests,
        max_log_len=args.max_log_len,
        generation_overrides=dict(args.override_generation_config or {}),
        generation_config=args.generation_config or "auto",
        structured_outputs=parse_structured_outputs_config(args.structured_outputs_config),
        max_sequences_per_request=args.max_sequences_per_request,
        max_queued_sequences=args.max_queued_sequences,
    )


def _log_notes(args: argparse.Namespace) -> None:
    if args.swap_space is not None:
        logger.info("--swap-space is ignored, as in vLLM V1: preempted requests are recomputed")
    if args.enable_reasoning:
        logger.info(
            "--enable-reasoning is deprecated in vLLM and ignored; --reasoning-parser "
            "alone turns reasoning parsing on"
        )
    if args.enforce_eager:
        logger.info("--enforce-eager: every step runs eagerly (CPU decode steps are not "
                    "recorded and replayed)")


def create_server_state(args: argparse.Namespace, core: CoreClient | None = None
                        ) -> tuple[AsyncEngine, ServerState, CollectorRegistry]:
    """Load the engine, or attach to it through ``core`` (an API process of several, whose
    launcher runs the engine); returns (AsyncEngine, ServerState, registry)."""
    from qwenserve.engine.async_engine import AsyncEngine
    from qwenserve.entrypoints.openai.cli_data_parallel import data_parallel_config
    from qwenserve.entrypoints.openai.serving_common import ServerState
    from qwenserve.metrics.loggers import LoggingStatLogger
    from qwenserve.metrics.prometheus import PrometheusStatLogger, make_registry

    deferred = _DeferredStatLogger()
    log_line = None if args.disable_log_stats else LoggingStatLogger()
    loggers: list[Any] = [deferred] if log_line is None else [deferred, log_line]
    if core is not None:
        engine = AsyncEngine(core, loggers)
    else:
        engine = AsyncEngine.from_engine_args(build_engine_args(args), stat_loggers=loggers,
                                              data_parallel=data_parallel_config(args))
    config = engine.config
    options = _options(args, config.model.name)
    root = getattr(config.model.source, "gguf_file", None) or config.model.source.folder
    state = ServerState(engine, options, model_root=root)
    if log_line is not None:
        log_line.mm_cache = state.images.cache_stats
    registry = make_registry()
    prom = PrometheusStatLogger(
        registry,
        state.model_name,
        state.max_model_len,
        show_hidden=args.show_hidden_metrics_for_version is not None,
        speculative=config.speculative is not None,
        engine_indexes=engine.engine_indexes,
        mm_cache=state.images.cache_stats,
    )
    plan = engine.plan
    prom.log_cache_config(
        config.cache.block_size,
        engine.enable_prefix_caching,
        config.cache.gpu_memory_utilization,
        plan.num_blocks,
        plan.kv_bytes,
    )
    deferred.target = prom
    return engine, state, registry


def log_summary(state: ServerState, engine: AsyncEngine, host: str, port: int, scheme: str) -> None:
    config, plan = engine.config, engine.plan
    mc = config.model
    engines = engine.engine_indexes
    logger.info(
        "Serving %s as %s: %s, dtype %s, on %s%s; max_model_len %d; KV cache %s tokens, maximum "
        "concurrency %.2fx at %s tokens per request%s; listening on %s://%s:%d",
        mc.name,
        ", ".join(repr(n) for n in state.options.served_model_names),
        mc.architecture,
        mc.dtype,
        engine.device_description,
        f" x {len(engines)} data-parallel engines (ranks {', '.join(map(str, engines))})"
        if len(engines) > 1 or engines != (0,) else "",
        state.max_model_len,
        f"{plan.token_capacity:,}",
        plan.max_concurrency(state.max_model_len),
        f"{state.max_model_len:,}",
        " per engine" if len(engines) > 1 else "",
        scheme,
        host,
        port,
    )


def run_headless_node(args: argparse.Namespace) -> int:
    """``qwenserve serve --headless``: this node's data-parallel engines, no API server."""
    from qwenserve.engine.dp_headless import run_headless
    from qwenserve.entrypoints.openai.cli_data_parallel import data_parallel_config

    logger.info("--headless: no API server on this node (--host/--port unused); its engines "
                "serve the head's")
    try:
        engine_args = build_engine_args(args)
    except Exception as e:  # noqa: BLE001 - one clean line instead of a traceback
        logger.error("Cannot start the engines: %s", e)
        return 1
    return run_headless(engine_args, data_parallel_config(args))


def run_server(args: argparse.Namespace) -> int:
    """``qwenserve serve``; returns the process exit code."""
    if args.headless:
        return run_headless_node(args)
    host = args.host or "0.0.0.0"
    try:
        sock = bind_socket(host, args.port)
    except OSError as e:
        logger.error(
            "Cannot listen on %s:%d: %s (another server may be running there; pick "
            "--port or stop it)",
            host,
            args.port,
            e,
        )
        return 1
    _log_notes(args)
    if (args.api_server_count or 1) > 1:
        from qwenserve.entrypoints.openai.multi_api_server import run_multi_api_server

        return run_multi_api_server(args, sock)
    try:
        from qwenserve.entrypoints.chat_utils import load_chat_template

        load_chat_template(args.chat_template)  # a missing file fails before the model loads
        engine, state, registry = create_server_state(args)
    except Exception as e:  # noqa: BLE001 - one clean line instead of a traceback
        logger.debug("Start-up failed", exc_info=True)
        logger.error("Cannot start the server: %s", e)
        sock.close()
        return 1
    try:
        app = build_server_app(args, state, registry)
        log_summary(state, engine, host, args.port, "https" if args.ssl_certfile else "http")
        engine_died = serve(app, sock, args, state)
    finally:
        logger.info("Shutting down the engine")
        engine.shutdown()
    return 1 if engine_died else 0


def build_server_app(args: argparse.Namespace, state: ServerState,
               registry: CollectorRegistry) -> FastAPI:
    from qwenserve.entrypoints.openai.app import build_app

    keys = [k for k in (args.api_key or [envs.api_key()]) if k]
    cors = {
        "allow_origins": args.allowed_origins,
        "allow_methods": args.allowed_methods,
        "allow_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
    }
    app = build_app(
        state,
        registry,
        api_keys=keys,
        max_body_bytes=args.max_request_body_bytes,
        cors=cors,
        echo_request_id=args.enable_request_id_headers,
        enable_docs=not args.disable_fastapi_docs,
        dev_mode=envs.server_dev_mode(),
    )
    for route in app.routes:
        methods = ", ".join(sorted(getattr(route, "methods", None) or []))
        logger.debug("Route: %s, Methods: %s", getattr(route, "path", route), methods)
    return app


def _http_protocol() -> type[TimedH11Protocol]:
    from qwenserve.entrypoints.openai.http_protocol import timed_protocol

    return timed_protocol(envs.http_header_timeout_s(), envs.http_body_timeout_s())


def serve(app: FastAPI, sock: socket.socket, args: argparse.Namespace, state: ServerState
          ) -> bool:
    """Serve until SIGTERM/SIGINT, or until the engine dies; True in the latter case."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not state.draining:
                state.draining = True
                logger.info(
                    "Received %s: no new requests; waiting up to %.0f s for %d running request(s)",
                    signal.Signals(sig).name,
                    args.shutdown_timeout,
                    state.engine.num_unfinished_requests(),
                )
                if self.qs_loop is not None:  # past the grace period, requests end cleanly
                    grace = args.shutdown_timeout
                    self.qs_loop.call_soon_threadsafe(state.start_grace_period, grace)
            super().handle_exit(sig, frame)

        qs_loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets: Any = None) -> None:
            self.qs_loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if self.started:  # uvicorn prints this only for sockets it binds itself
                host, port = sock.getsockname()[:2]
                scheme = "https" if args.ssl_certfile else "http"
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", scheme, host, port
                )

    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.http_timeout_keep_alive_s(),
        http=_http_protocol(),
        # uvicorn's own cut-off comes later than ours (ServerState.stopping), as a backstop.
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path or "",
    )
    # uvicorn re-raises the signal it caught once it has shut down; with these handlers in place
    # that re-raise is a no-op and the process exits 0 after a clean drain.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = _Server(config)
    engine_died = watch_engine(state.engine, server)
    server.run(sockets=[sock])
    return engine_died.is_set()


def watch_engine(engine: Any, server: Any) -> threading.Event:
    """When the engine dies, stop serving so that the process exits 1 and a supervisor
    (systemd ``Restart=on-failure``, Kubernetes) restarts it, as vLLM does; with
    ``QWENSERVE_KEEP_ALIVE_ON_ENGINE_DEATH=1`` keep answering (``/health`` 503) instead."""
    died = threading.Event()
    keep_alive = envs.keep_alive_on_engine_death()

    def on_dead(error: BaseException) -> None:
        if keep_alive:
            logger.error("The engine is dead (%s); the server stays up as "
                         "QWENSERVE_KEEP_ALIVE_ON_ENGINE_DEATH is set, and /health answers 503",
                         error)
            return
        logger.error("The engine is dead (%s); shutting the server down", error)
        died.set()
        server.should_exit = True

    engine.add_dead_callback(on_dead)
    return died


# ``qwenserve serve`` (entrypoints/cli.py): this module's parser class, flags and runner.
PARSER_CLASS = ServeArgumentParser


def run(args: argparse.Namespace) -> int:
    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    parser = make_serve_parser()
    parser.prog = "python -m qwenserve.entrypoints.openai.api_server"
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
