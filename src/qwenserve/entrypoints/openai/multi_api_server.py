"""``--api-server-count N``: N API server processes on one listening socket and one engine core.

    launcher (``qwenserve serve``)                     API server process i (this module's main)
    bind the port; start the engine(s) (CoreClient)
    CoreHub: ipc in-i/out-i per process  <- ZMQ ->     HubCoreClient -> AsyncEngine -> FastAPI
    Popen(pass_fds=[listening socket])   ------->      uvicorn on the inherited socket

The kernel spreads new connections over the processes accepting on the shared socket. Metrics:
the API processes run in ``prometheus_client``'s multiprocess mode over one folder, so
``/metrics`` of any of them shows every process's series (the engine's statistics are counted
by process 0 alone, ``core_hub.py``). Each response names its process in the
``x-qwenserve-api-server`` header.

Lifecycle: SIGTERM or SIGINT to the launcher is passed on as one SIGTERM to each API process
(they run in their own session, so a terminal's Ctrl+C reaches them once, through here); each
drains as a single server does; then the launcher stops the engine. An API process that exits on
its own, or the engine dying (every API process then exits 1), takes the server down with exit
code 1. If the launcher itself dies, its pipes close and every API and engine process exits.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from qwenserve.engine.core_hub import HubAddresses
from qwenserve.logger import init_logger

logger = init_logger("qwenserve.entrypoints.openai.multi_api_server")

HEADER = b"x-qwenserve-api-server"


@dataclass(frozen=True)
class WorkerArguments:
    args: argparse.Namespace
    socket_fd: int
    addresses: HubAddresses
    index: int


def run_multi_api_server(args: argparse.Namespace, sock: socket.socket) -> int:
    """Start the engine(s), the hub and ``args.api_server_count`` API processes; serve until a
    signal or a death. Returns the exit code."""
    from qwenserve.engine.async_engine import start_core_client
    from qwenserve.engine.core_hub import CoreHub
    from qwenserve.entrypoints.openai.api_server import build_engine_args
    from qwenserve.entrypoints.openai.cli_data_parallel import data_parallel_config

    count = args.api_server_count
    try:
        from qwenserve.entrypoints.chat_utils import load_chat_template

        load_chat_template(args.chat_template)  # a missing file fails before the model loads
        core = start_core_client(build_engine_args(args), data_parallel=data_parallel_config(args))
    except Exception as e:  # noqa: BLE001 - one clean line instead of a traceback
        logger.debug("Start-up failed", exc_info=True)
        logger.error("Cannot start the server: %s", e)
        sock.close()
        return 1
    hub = CoreHub(core, count)
    hub.start()
    metrics_dir = tempfile.mkdtemp(prefix="qwenserve-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    procs: list[subprocess.Popen] = []
    try:
        for index, addresses in enumerate(hub.addresses):
            procs.append(_spawn(WorkerArguments(args, sock.fileno(), addresses, index), env))
        logger.info("%d API server processes (pids %s) share the port", count,
                    ", ".join(str(p.pid) for p in procs))
        return _supervise(procs, hub)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        logger.info("Shutting down the engine")
        hub.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        sock.close()


def _spawn(worker: WorkerArguments, env: dict[str, str]) -> subprocess.Popen:
    from qwenserve.engine.rank_process import send_message

    proc = subprocess.Popen([sys.executable, "-m", "qwenserve.entrypoints.openai.multi_api_server"],
                            stdin=subprocess.PIPE, pass_fds=(worker.socket_fd,), env=env,
                            start_new_session=True)
    send_message(proc, worker)
    return proc


def _supervise(procs: list[subprocess.Popen], hub: Any) -> int:
    """Wait for the API processes; pass a signal on once; bring all down when one exits
    unbidden (its requests in the engine are aborted)."""
    stopping = threading.Event()

    def stop(sig: int, _frame: Any) -> None:
        if not stopping.is_set():
            logger.info("Received %s: draining the %d API server processes",
                        signal.Signals(sig).name, len(procs))
            stopping.set()
            _terminate(procs)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    failed = False
    live = set(range(len(procs)))
    while live:
        for index in sorted(live):
            code = procs[index].poll()
            if code is None:
                continue
            live.discard(index)
            hub.abort_client(index)
            if not stopping.is_set() or code != 0:
                failed = True
                logger.error("API server process %d (pid %d) exited (code %d)%s", index,
                             procs[index].pid, code,
                             "" if stopping.is_set() else "; shutting the server down")
            if not stopping.is_set():
                stopping.set()
                _terminate(procs)
        time.sleep(0.1)
    return 1 if failed else 0


def _terminate(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def _with_header(app: Any, index: int) -> Any:
    """Name this API process in every HTTP response (``x-qwenserve-api-server: i``)."""
    value = str(index).encode()

    async def wrapped(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (HEADER, value)]}
            await send(message)

        return await app(scope, receive, send_named)

    return wrapped


def serve_worker(worker: WorkerArguments) -> int:
    """One API server process: attach to the hub, build the app, serve the shared socket."""
    from qwenserve.engine.hub_client import HubCoreClient
    from qwenserve.entrypoints.openai import api_server

    args = worker.args
    sock = socket.socket(fileno=worker.socket_fd)
    try:
        engine, state, registry = api_server.create_server_state(
            args, core=HubCoreClient(worker.addresses))
    except Exception as e:  # noqa: BLE001 - one clean line instead of a traceback
        logger.error("API server process %d cannot start: %s", worker.index, e)
        return 1
    try:
        app = api_server.build_server_app(args, state, registry)
        if worker.index == 0:
            host, port = sock.getsockname()[:2]
            api_server.log_summary(state, engine, host, port,
                                    "https" if args.ssl_certfile else "http")
        died = api_server.serve(_with_header(app, worker.index), sock, args, state)
    finally:
        engine.shutdown()
    return 1 if died else 0


def main() -> None:
    from qwenserve.engine.rank_process import DriverLink, read_message

    payload = read_message(0)  # at once: the launcher writes it right after spawning
    if payload is None:
        raise SystemExit(1)
    DriverLink(0, os.getppid(), role="API server process").watch()
    code = serve_worker(pickle.loads(payload))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
