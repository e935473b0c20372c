"""Attention backends by name; a platform names its default, a faster one can be added as a file."""

from __future__ import annotations

import importlib

from qwenserve.layers.attention.base import AttentionBackend, AttentionMetadata, ChunkLayout

_BACKENDS = {
    "torch_ref": ("qwenserve.layers.attention.torch_ref", "TorchRefBackend"),
    "cpu_native": ("qwenserve.layers.attention.cpu_native", "CpuNativeBackend"),
}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; known: {', '.join(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["AttentionBackend", "AttentionMetadata", "ChunkLayout", "get_attention_backend"]
