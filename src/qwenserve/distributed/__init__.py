"""Tensor-parallel group as a value passed to the layers that need it (no global state)."""

from __future__ import annotations

from qwenserve.distributed.parallel_group import ParallelGroup

__all__ = ["ParallelGroup"]
