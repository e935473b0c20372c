"""`qwenserve` command line: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (and may name
its parser class as ``PARSER_CLASS``) and is imported
only when that subcommand is used, so ``qwenserve doctor`` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("qwenserve.entrypoints.openai.api_server", "Start the OpenAI-compatible API server"),
    "disagg-proxy": ("qwenserve.entrypoints.disagg_proxy",
                     "Prefill/decode proxy in front of kv_producer and kv_consumer servers"),
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
    module = importlib.import_module(SUBCOMMANDS[subcommand][0]) if subcommand else None
    # A module may name its own parser class (``serve`` validates its flags on every parse).
    parser_class = getattr(module, "PARSER_CLASS", argparse.ArgumentParser)
    subparsers = parser.add_subparsers(
        dest="subcommand", metavar="COMMAND", parser_class=parser_class
    )
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == subcommand and module is not None:
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
