"""Platform resolution: ``QWENSERVE_PLATFORM`` override, else detection npu > cuda > cpu.

Each process resolves its platform once, where it starts (``LLMEngine.from_engine_args``, a
tensor-parallel rank process), and passes the object down; nothing looks it up globally.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from qwenserve import envs

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform

_PLATFORMS = {
    "npu": ("qwenserve.platforms.npu", "NpuPlatform"),
    "cuda": ("qwenserve.platforms.cuda", "CudaPlatform"),
    "cpu": ("qwenserve.platforms.cpu", "CpuPlatform"),
}


def _load(name: str) -> type[Platform]:
    module_name, class_name = _PLATFORMS[name]
    return getattr(importlib.import_module(module_name), class_name)


def resolve_platform(name: str | None = None) -> Platform:
    """The platform object for ``name``, or the detected one (call once, at an entry point)."""
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
