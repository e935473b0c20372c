"""Record the native kernel calls of a stretch of code, and replay them.

A decode step of a model whose every op is a native kernel is, once its shapes are fixed, the
same list of ctypes calls on the same buffers each step: only the buffers' contents change.
``record_calls`` keeps that list while the code runs eagerly; ``replay`` makes the calls again
without the Python that chose them (the per-layer modules, routing and tensor bookkeeping: ~5 ms
of a 34 ms batch-1 step on the Qwen2.5-0.5B shape). It is the CPU's counterpart of a CUDA graph;
``worker/decode_replay.py`` decides when a recording is valid and keeps its buffers alive.

Every library ``build.load_library`` loads makes its functions through ``recording_function_type``,
so no kernel face needs to know about recording.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class NativeCall:
    """One call of a native entry point: its arguments as ctypes took them, and its result."""

    fn: ctypes._CFuncPtr
    args: tuple[int | float | None, ...]
    result: int | None


_active: list[list[NativeCall]] = []  # the recording in progress, if any (at most one)
_base_call = ctypes._CFuncPtr.__call__


def _call(fn: ctypes._CFuncPtr, *args: int | float | None) -> int | None:
    result = _base_call(fn, *args)
    if _active:
        _active[0].append(NativeCall(fn, args, result))
    return result


def recording_function_type(lib: ctypes.CDLL) -> type:
    """The function class ``lib`` makes its entry points with: its own, recording when asked."""
    base = lib._FuncPtr
    return type("_RecordingFuncPtr", (base,), {"__call__": _call, "_flags_": base._flags_,
                                               "_restype_": base._restype_})


@contextlib.contextmanager
def record_calls() -> Iterator[list[NativeCall]]:
    """Collect every native call made inside the block, in order (not re-entrant)."""
    if _active:
        raise RuntimeError("native calls are already being recorded")
    calls: list[NativeCall] = []
    _active.append(calls)
    try:
        yield calls
    finally:
        _active.clear()


def replay(calls: list[NativeCall]) -> int | None:
    """Make ``calls`` again in order; stop at the first whose status differs from the recorded
    one (a kernel refusing this step's data) and return its index, else None."""
    for i, call in enumerate(calls):
        if _base_call(call.fn, *call.args) != call.result:
            return i
    return None
