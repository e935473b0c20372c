"""Platform resolution: ``QWENSERVE_PLATFORM`` override, else detection npu > cuda > cpu."""

from __future__ import annotations

import functools
import importlib

from qwenserve import envs

_PLATFORMS = {
    "npu": ("qwenserve.platforms.npu", "NpuPlatform"),
    "cuda": ("qwenserve.platforms.cuda", "CudaPlatform"),
    "cpu": ("qwenserve.platforms.cpu", "CpuPlatform"),
}


def _load(name: str):
    module_name, class_name = _PLATFORMS[name]
    return getattr(importlib.import_module(module_name), class_name)


@functools.cache
def resolve_platform(name: str | None = None):
    """The platform object for ``name``, or the detected one; resolved once per process."""
    name = name or envs.platform_override()
    if name is not None:
        if name not in _PLATFORMS:
            raise ValueError(f"QWENSERVE_PLATFORM={name!r} is unknown; use one of "
                             f"{', '.join(_PLATFORMS)}")
        return _load(name)()
    for candidate in _PLATFORMS:
        cls = _load(candidate)
        if cls.is_available():
            return cls()
    raise AssertionError("the CPU platform is always available")


def current_platform():
    return resolve_platform(None)
