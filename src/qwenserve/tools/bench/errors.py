"""The one error type the benchmark shows to users.

Anything wrong with the input (server, model name, dataset, API key, flags) raises ``BenchError``
with a one-line message before the load starts; ``cli.run`` prints it and exits non-zero, so users
never read a traceback for a typo. Failures *during* a run are not errors: they are counted.
"""

from __future__ import annotations


class BenchError(Exception):
    """A user-facing, one-line reason why the benchmark cannot run."""


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's text, or its type name."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
