"""``qwenserve bench serve|throughput|latency``: argument wiring and error reporting.

``serve`` is a pure HTTP client and must start on a machine without torch, so each subcommand's
module is imported only when that subcommand runs; the offline ones (``throughput``, ``latency``)
load the engine, and only they import it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with add_arguments/run, help)
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("qwenserve.tools.bench.serve", "Load an OpenAI-compatible server (vLLM's figures)"),
    "throughput": ("qwenserve.tools.bench.throughput", "Offline throughput, engine in-process"),
    "latency": ("qwenserve.tools.bench.latency", "Latency of one batch, engine in-process"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench sub-subcommands; only the one named on the command line is imported."""
    chosen = _chosen_command(sys.argv[1:])
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    for name, (module_name, help_text) in BENCH_COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen or chosen is None:
            module = importlib.import_module(module_name)
            module.add_arguments(cmd)
            cmd.set_defaults(_bench_run=module.run)


def _chosen_command(argv: list[str]) -> str | None:
    """The word after ``bench``, if it names a bench command (else load all for ``--help``)."""
    words = [a for a in argv if not a.startswith("-")]
    if "bench" in words:
        index = words.index("bench")
        if index + 1 < len(words) and words[index + 1] in BENCH_COMMANDS:
            return words[index + 1]
    return None


def run(args: argparse.Namespace) -> int:
    """Run the chosen bench command; a ``BenchError`` becomes one line on stderr and exit 1."""
    from qwenserve.tools.bench.errors import BenchError

    runner = getattr(args, "_bench_run", None)
    if runner is None:
        print("usage: qwenserve bench {serve,throughput,latency} ...", file=sys.stderr)
        return 2
    try:
        return int(runner(args) or 0)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
