"""Gated DeltaNet (Qwen3.5 linear-attention) kernels: the seam in ``base``, the reference in
``torch_ref``/``delta_rule``, the CPU backend in ``fused``, and the gated RMSNorm that ends the layer."""

from __future__ import annotations

from qwenserve.layers.recurrent.base import (
    DEFAULT_CHUNK_SIZE,
    GDNMetadata,
    RecurrentBackend,
    build_gdn_metadata,
)
from qwenserve.layers.recurrent.fused import FusedRecurrentBackend
from qwenserve.layers.recurrent.gated_norm import RMSNormGated, rms_norm_gated
from qwenserve.layers.recurrent.gating import gdn_gating
from qwenserve.layers.recurrent.torch_ref import (
    TorchRefRecurrentBackend,
    causal_conv1d_varlen,
    gated_delta_net_forward,
)

_BACKENDS: dict[str, type[RecurrentBackend]] = {
    "torch_ref": TorchRefRecurrentBackend,
    "fused": FusedRecurrentBackend,  # CPU: native decode/conv, merged chunk scan
}


def get_recurrent_backend(name: str) -> RecurrentBackend:
    """A platform names its Gated DeltaNet kernels (``Platform.default_recurrent_backend``)."""
    if name not in _BACKENDS:
        raise ValueError(f"recurrent backend {name!r} is unknown; known: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]()


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FusedRecurrentBackend",
    "GDNMetadata",
    "RMSNormGated",
    "RecurrentBackend",
    "TorchRefRecurrentBackend",
    "build_gdn_metadata",
    "causal_conv1d_varlen",
    "gated_delta_net_forward",
    "gdn_gating",
    "get_recurrent_backend",
    "rms_norm_gated",
]
