"""Logging set-up: one format for every module, level from ``QWENSERVE_LOGGING_LEVEL``."""

from __future__ import annotations

import logging
import sys

from qwenserve import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_configured: list[bool] = []  # set once; a list avoids a module-level `global` statement


def init_logger(name: str) -> logging.Logger:
    """Return the logger for ``name`` with the qwenserve handler installed on the package root."""
    if not _configured:
        root = logging.getLogger("qwenserve")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.logging_level())
        root.propagate = False
        _configured.append(True)
    return logging.getLogger(name)
