"""`qwenserve` command line: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is imported
only when that subcommand is used, so ``qwenserve doctor`` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("qwenserve.entrypoints.openai.cli_args", "Start the OpenAI-compatible API server"),
    "chat": ("qwenserve.entrypoints.chat", "Chat with a model in the terminal (offline)"),
    "bench": ("qwenserve.tools.bench.cli", "Benchmark: serve | throughput | latency"),
    "plan": ("qwenserve.tools.plan.cli", "Will a model fit? Memory plan and the flags to use"),
    "doctor": ("qwenserve.tools.doctor", "Check this machine and a model folder"),
    "diagnose": ("qwenserve.tools.diagnose", "Explain a server log: root cause and fix"),
    "deploy": ("qwenserve.tools.deploy.cli", "Write production configs (systemd, nginx, k8s, ...)"),
}


def build_parser(subcommand: str | None) -> argparse.ArgumentParser:
    """Build the top-level parser; only ``subcommand``'s module is imported."""
    parser = argparse.ArgumentParser(
        prog="qwenserve",
        description="qwenserve: serve Qwen models with vLLM's flags and API.",
    )
    from qwenserve import __version__

    parser.add_argument("--version", action="version", version=f"qwenserve {__version__}")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == subcommand:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    subcommand = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(subcommand if subcommand in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0 if not argv else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
