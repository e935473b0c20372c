"""Quantization methods: detection from the checkpoint, and the user's ``--quantization``."""

from __future__ import annotations

from typing import Any


def resolve_quantization(hf_config: Any, requested: str | None) -> tuple[str | None, dict | None]:
    """Return (method, checkpoint quantization config); refuse contradictions and unknowns."""
    ckpt = getattr(hf_config, "quantization_config", None)
    if ckpt is not None and not isinstance(ckpt, dict):
        ckpt = ckpt.to_dict() if hasattr(ckpt, "to_dict") else dict(vars(ckpt))
    if ckpt is None:
        if requested in (None, "int8"):
            if requested == "int8":
                raise ValueError("--quantization int8 (load-time INT8) is not implemented yet; "
                                 "remove the flag to serve the model unquantized")
            return None, None
        raise ValueError(f"--quantization {requested} was given but the checkpoint has no "
                         "quantization_config; remove the flag, or use a quantized checkpoint")
    method = ckpt.get("quant_method", "unknown")
    raise ValueError(f"The checkpoint is quantized with {method!r}, which qwenserve cannot load "
                     "yet; use an unquantized (bf16/fp16/fp32) checkpoint")
