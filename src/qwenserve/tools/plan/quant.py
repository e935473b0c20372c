"""Which weight width to plan with: the ``--quantization`` flag, else the checkpoint's own.

A quantized checkpoint says so in ``config.json`` (``quantization_config``) or, for Ascend
ModelSlim, in ``quant_model_description.json``; planning it at bfloat16 would overstate its
weights 2-4x. Whether qwenserve itself can run it is the engine's own decision
(``quantization.schemes``), so plan and serve never disagree about it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from qwenserve.quantization.schemes import MODELSLIM_DESCRIPTION


@dataclass(frozen=True)
class QuantChoice:
    width: str | None  # a key of devices.QUANT_WIDTHS
    from_checkpoint: bool  # True: read from the checkpoint, so no flag is needed to serve it
    modelslim: bool = False  # vLLM Ascend needs --quantization ascend for these


def checkpoint_quantization(hf_config: Any, folder: str | None) -> QuantChoice:
    """The width the checkpoint's weights are stored at (None: a float checkpoint)."""
    if folder and os.path.isfile(os.path.join(folder, MODELSLIM_DESCRIPTION)):
        return QuantChoice("w8a8", True, modelslim=True)
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return QuantChoice(None, False)
    config = config if isinstance(config, dict) else config.to_dict()
    method = str(config.get("quant_method") or "").lower()
    bits = int(config.get("bits") or config.get("w_bit") or 8)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        return QuantChoice(method.split("_")[0] if bits == 4 else "w8a8", True)
    if method in ("fp8", "fbgemm_fp8"):
        return QuantChoice("fp8", True)
    if method == "compressed-tensors":
        return QuantChoice(_compressed_tensors_width(config), True)
    raise ValueError(
        f"config.json's quantization_config has quant_method {method or '(none)'!r}"
        ", whose weight width plan does not know; pass --quantization "
        "w8a8|fp8|awq|gptq to plan it"
    )


def _compressed_tensors_width(config: dict) -> str:
    weights = [(g.get("weights") or {}) for g in (config.get("config_groups") or {}).values()]
    bits = {int(w.get("num_bits") or 8) for w in weights} or {8}
    if max(bits) <= 4:
        return "w4a16"
    return "fp8" if any(w.get("type") == "float" for w in weights) else "w8a8"


def qwenserve_problem(hf_config: Any, requested: str | None, checkpoint: QuantChoice) -> str | None:
    """Why ``qwenserve serve`` cannot run this plan (None: it can), in the engine's words."""
    if requested in ("fp8", "awq", "gptq", "w4a16"):
        return (
            f"qwenserve does not run {requested} weights (it runs INT8 W8A8 checkpoints, or "
            "--quantization int8 at load time)"
        )
    if requested == "w8a8" and checkpoint.width is None:
        return None  # planned for a W8A8 checkpoint of this model: a note says so
    from qwenserve.quantization import resolve_quantization

    try:
        resolve_quantization(hf_config, requested if requested != "w8a8" else None)
    except ValueError as e:
        return str(e)
    return None
