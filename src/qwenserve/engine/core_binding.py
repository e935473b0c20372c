"""Where the engine process's OpenMP threads run (``QWENSERVE_CPU_OMP_THREADS_BIND``, vLLM's
``VLLM_CPU_OMP_THREADS_BIND``). Applied before torch is imported, as OpenMP reads it once.

- ``auto`` (default): with 4 or more usable cores, one OpenMP thread pinned to each core but the
  last, which is left to the API process (HTTP, tokenization, SSE). With fewer, one thread per
  core and no pinning: reserving one of two cores would halve the engine.
- ``all``: one thread pinned to each usable core.
- a core list such as ``0-3,6``: one thread pinned to each of those cores.
- ``nobind``: leave threads and placement to OpenMP's own defaults.

Unpinned (``auto`` on few cores, ``nobind``), OpenMP threads wait passively
(``OMP_WAIT_POLICY=PASSIVE``) unless the user set a policy. An ``OMP_NUM_THREADS`` set by the
user is kept. With tensor parallelism the engine process is
the rank-0 driver and placement is left to the ranks (no binding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Binding:
    cores: tuple[int, ...] | None  # pin to these (one OpenMP thread each), or None: no pinning
    num_threads: int | None  # OMP_NUM_THREADS to set, or None: leave it

    def describe(self) -> str:
        threads = "OpenMP's default" if self.num_threads is None else self.num_threads
        where = "unpinned" if self.cores is None else f"pinned to cores {_ranges(self.cores)}"
        return f"{threads} OpenMP thread(s), {where}"


def parse_cores(spec: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6)."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError as e:
        raise ValueError(f"QWENSERVE_CPU_OMP_THREADS_BIND={spec!r} is not auto, all, nobind or a "
                         "core list such as 0-3,6") from e
    if not cores:
        raise ValueError(f"QWENSERVE_CPU_OMP_THREADS_BIND={spec!r} names no cores")
    return tuple(sorted(set(cores)))


def plan_binding(spec: str, available: list[int], tensor_parallel_size: int = 1) -> Binding:
    spec = spec.strip().lower()
    if spec == "nobind" or tensor_parallel_size > 1:
        return Binding(None, None)
    if spec == "auto":
        if len(available) < 4:
            return Binding(None, len(available))
        cores = tuple(available[:-1])
    elif spec == "all":
        cores = tuple(available)
    else:
        cores = parse_cores(spec)
        missing = sorted(set(cores) - set(available))
        if missing:
            raise ValueError(f"QWENSERVE_CPU_OMP_THREADS_BIND={spec!r}: core(s) {missing} are not "
                             f"usable by this process (usable: {_ranges(tuple(available))})")
    return Binding(cores, len(cores))


def apply_binding(binding: Binding) -> None:
    """Set this process's affinity and OpenMP environment (before torch is imported)."""
    if binding.num_threads is not None and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(binding.num_threads)
    if binding.cores is None:
        # Unpinned threads share their cores with the API process (and anything else running):
        # spinning OpenMP workers then steal the time the others need, and a descheduled
        # worker stalls the rest at every barrier. Sleeping waits avoid both (docs/serving.md).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return
    os.sched_setaffinity(0, binding.cores)
    if not os.environ.get("OMP_PLACES") and not os.environ.get("GOMP_CPU_AFFINITY"):
        os.environ["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in binding.cores)
        os.environ.setdefault("OMP_PROC_BIND", "close")


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _ranges(cores: tuple[int, ...]) -> str:
    out: list[str] = []
    start = prev = cores[0]
    for c in (*cores[1:], None):
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)
