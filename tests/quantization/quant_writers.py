"""Writers of INT8 checkpoints from a float model folder, written from the format descriptions
(not with qwenserve code, so the round trip tests the loader against the spec):

- compressed-tensors (llm-compressor's INT8 W8A8, ``format: int-quantized``): per linear layer
  ``weight`` int8 [out, in] and ``weight_scale`` [out, 1] (w ~= weight * weight_scale), a
  ``quantization_config`` in config.json with ``config_groups`` and ``ignore: ["lm_head"]``.
- Ascend ModelSlim W8A8 (msmodelslim's safetensors export): ``weight`` int8, ``input_scale`` /
  ``input_offset`` [1] float32 (static, asymmetric, calibrated), ``deq_scale`` [out] (float32,
  or for fp16 models int64 holding the float32 bits), ``quant_bias`` [out] int32 =
  round(bias / deq_scale - input_offset * weight.sum(1)), ``weight_scale`` / ``weight_offset``
  [out, 1], the float ``bias`` kept; W8A8_DYNAMIC has ``weight``, ``weight_scale``,
  ``weight_offset`` and ``bias``. ``quant_model_description.json`` maps every tensor name to
  "W8A8" / "W8A8_DYNAMIC" / "FLOAT".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
# MoE models: also every routed expert's and the shared expert's projections (the router
# ``mlp.gate`` and ``shared_expert_gate`` stay float, as llm-compressor and ModelSlim leave them).
MOE_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_expert)"
                        r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
EXPERT = re.compile(r"\.mlp\.(experts\.\d+|shared_expert)\.")

CT_W8A8_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                "dynamic": False, "group_size": None, "actorder": None, "block_structure": None,
                "observer": "minmax", "observer_kwargs": {}},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                          "dynamic": True, "group_size": None, "actorder": None,
                          "block_structure": None, "observer": None, "observer_kwargs": {}},
    "output_activations": None,
    "format": None,
}


def _read(folder: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _copy_folder(src: str, dst: str) -> dict:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def _write_config(dst: str, config: dict) -> None:
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8, in float64: (int8 [out, in], scale [out, 1])."""
    w = weight.double()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.float()


def ct_quantization_config(**group_overrides) -> dict:
    group = {**CT_W8A8_GROUP, **group_overrides}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None, "version": "0.12.2"}


def write_compressed_tensors(src: str, dst: str, quantization_config: dict | None = None,
                             linear: re.Pattern = LINEAR) -> str:
    """Quantize every decoder linear layer of ``src`` (those ``linear`` matches) into ``dst``
    (lm_head stays float)."""
    config = _copy_folder(src, dst)
    tensors = {}
    for name, tensor in _read(src).items():
        if linear.search(name):
            tensors[name], tensors[name + "_scale"] = quantize_channels(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    config["quantization_config"] = quantization_config or ct_quantization_config()
    _write_config(dst, config)
    return dst


def _static_tensors(module: str, weight: torch.Tensor, bias: torch.Tensor | None,
                    act_range: tuple[float, float], int64_deq: bool) -> dict[str, torch.Tensor]:
    """msmodelslim's W8A8 export of one linear layer, from its float weight and the calibrated
    [min, max] of its input."""
    weight_q, weight_scale = quantize_channels(weight)
    lo, hi = min(act_range[0], 0.0), max(act_range[1], 0.0)
    input_scale = (hi - lo) / 255.0
    input_offset = round(-128 - lo / input_scale)  # x_q = round(x / s + o) spans [-128, 127]
    deq = (input_scale * weight_scale.double()).squeeze(1)  # [out]
    fp_bias = bias.double() if bias is not None else torch.zeros(weight.shape[0]).double()
    quant_bias = torch.round(fp_bias / deq - input_offset * weight_q.double().sum(dim=1))
    deq32 = deq.float()
    if int64_deq:  # fp16 models: float32 bits in an int64, as msmodelslim's deqscale2int64
        deq32 = deq32.view(torch.int32).to(torch.int64)
    return {f"{module}.weight": weight_q,
            f"{module}.input_scale": torch.tensor([input_scale], dtype=torch.float32),
            f"{module}.input_offset": torch.tensor([float(input_offset)]),
            f"{module}.deq_scale": deq32,
            f"{module}.quant_bias": quant_bias.to(torch.int32),
            f"{module}.weight_scale": weight_scale,
            f"{module}.weight_offset": torch.zeros_like(weight_scale)}


@torch.no_grad()
def calibrate(src: str, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    """min / max of every linear layer's input over ``prompts`` (ModelSlim's minmax observer)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ranges: dict[str, tuple[float, float]] = {}

    def hook(name):
        def record(_module, inputs):
            x = inputs[0]
            lo, hi = ranges.get(name, (float("inf"), float("-inf")))
            ranges[name] = (min(lo, x.min().item()), max(hi, x.max().item()))
        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(hook(name))
    for ids in prompts:
        model(torch.tensor([ids]))
    return ranges


def moe_mixed_type(name: str) -> str:
    """vLLM Ascend's MoE W8A8 recipes: attention static W8A8, experts W8A8_DYNAMIC, the dense
    MLP layers left FLOAT (a mixed description)."""
    if EXPERT.search(name):
        return "W8A8_DYNAMIC"
    return "W8A8" if ".self_attn." in name else "FLOAT"


def write_modelslim(src: str, dst: str, act_ranges: dict[str, tuple[float, float]] | None = None,
                    dynamic: bool = False, int64_deq: bool = False,
                    type_of: Callable[[str], str] | None = None,
                    linear: re.Pattern = LINEAR) -> str:
    """W8A8 (static, needs ``act_ranges`` from ``calibrate``) or W8A8_DYNAMIC export of ``src``;
    ``type_of(weight name)`` picks W8A8 / W8A8_DYNAMIC / FLOAT per layer instead."""
    _copy_folder(src, dst)  # config.json unchanged: ModelSlim adds no quantization_config
    model_type = "W8A8_DYNAMIC" if dynamic else "W8A8"
    float_tensors = _read(src)
    tensors, description = {}, {"model_quant_type": model_type, "version": "1.0.0"}
    for name, tensor in float_tensors.items():
        type_of = type_of or (lambda _: model_type)
        quant_type = type_of(name) if linear.search(name) else "FLOAT"
        if quant_type == "FLOAT":
            weight = name[:-5] + ".weight"
            if not (name.endswith(".bias") and weight in float_tensors and linear.search(weight)
                    and type_of(weight) != "FLOAT"):  # a quantized layer writes its own bias
                tensors[name], description[name] = tensor, "FLOAT"
            continue
        module = name[: -len(".weight")]
        bias = float_tensors.get(module + ".bias")
        if quant_type == "W8A8_DYNAMIC":
            weight_q, weight_scale = quantize_channels(tensor)
            layer = {name: weight_q, f"{module}.weight_scale": weight_scale,
                     f"{module}.weight_offset": torch.zeros_like(weight_scale)}
        else:
            layer = _static_tensors(module, tensor, bias, act_ranges[module], int64_deq)
        if bias is not None:
            layer[f"{module}.bias"] = bias
        for key, value in layer.items():
            tensors[key] = value
            description[key] = "FLOAT" if key.endswith(".bias") else quant_type
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "quant_model_description.json"), "w") as f:
        json.dump(description, f, indent=2)
    return dst
