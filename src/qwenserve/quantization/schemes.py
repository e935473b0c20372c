"""Which quantization a checkpoint uses and whether qwenserve can run it (no torch here, so a
wrong flag or an unsupported scheme fails at start-up, before any weight is read).

    compressed-tensors  config.json ``quantization_config.quant_method == "compressed-tensors"``
                        (llm-compressor): ``weight`` int8 [out, in], ``weight_scale`` [out, 1]
    ascend (ModelSlim)  ``quant_model_description.json`` beside the weights: one entry per tensor,
                        "W8A8" | "W8A8_DYNAMIC" | "FLOAT" (vLLM Ascend's ``--quantization ascend``)
    int8                a float checkpoint quantized while it loads (``--quantization int8``)
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The one list of methods: what ``ModelConfig.quantization`` may hold, and the ``--quantization``
# choices (``w8a8``: whichever INT8 W8A8 format the checkpoint has).
METHODS = ("compressed-tensors", "ascend", "int8")
FLAG_CHOICES = (*METHODS, "w8a8")
MODELSLIM_DESCRIPTION = "quant_model_description.json"
CT_FORMATS = ("int-quantized", "naive-quantized")  # both store int8 weights for 8-bit ints
MODELSLIM_LINEAR_TYPES = ("W8A8", "W8A8_DYNAMIC")
# Checkpoint names of the merged layers (the models' ``stacked`` tables map them at load).
MERGED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj"),
                 "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}  # Qwen3.5
_DESCRIBED = {"compressed-tensors": "a compressed-tensors checkpoint (quantization_config)",
              "ascend": f"an Ascend ModelSlim checkpoint ({MODELSLIM_DESCRIPTION})"}
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# MoE gates: the router (``mlp.gate``, [E, H]) and Qwen3.5's ``shared_expert_gate`` ([1, H]) are
# Linear layers in HF that both exporters leave float (llm-compressor's MoE recipes ignore them).
_MOE_GATES = re.compile(r"\.mlp\.(gate|shared_expert_gate)$")
# Vision-language checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-VL) nest the text model under
# ``model.language_model.``; the models load it as ``model.`` (as vLLM's weights mapper does), so
# quantization configs written with either name are read by the text model's names.
_VLM_TEXT, _TEXT = "model.language_model.", "model."
_MODELSLIM_UNSUPPORTED_KEYS = ("fa_quant_type", "kv_cache_type", "kv_quant_type",
                               "indexer_quant_type")


def shard_names(prefix: str) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the q/k/v names the checkpoint uses."""
    head, _, last = prefix.rpartition(".")
    if last in MERGED_SHARDS:
        return [f"{head}.{shard}" if head else shard for shard in MERGED_SHARDS[last]]
    return [prefix]


# ---- detection and the --quantization flag ------------------------------------------------------
def resolve(hf_config: PretrainedConfig, requested: str | None) -> tuple[str | None, dict | None]:
    """(method, config): the checkpoint's method reconciled with the user's flag."""
    detected, config = detect(hf_config)
    method = _reconcile(detected, requested)
    if method == "int8":
        return "int8", {"quant_method": "int8"}
    return method, config


def detect(hf_config: PretrainedConfig) -> tuple[str | None, dict | None]:
    """Read the checkpoint's quantization; refuse what qwenserve cannot run."""
    ckpt = _as_dict(getattr(hf_config, "quantization_config", None))
    folder = str(getattr(hf_config, "_name_or_path", "") or "")
    desc_path = os.path.join(folder, MODELSLIM_DESCRIPTION) if folder else ""
    quant_method = (ckpt or {}).get("quant_method")
    moe = bool(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0))
    if quant_method == "compressed-tensors":
        validate_compressed_tensors(ckpt)
        shared = bool(getattr(hf_config, "shared_expert_intermediate_size", 0))
        gates = ["model.layers.0.mlp.gate"] if moe else []
        for gate in gates + (["model.layers.0.mlp.shared_expert_gate"] if shared else []):
            if ct_scheme_for(gate, ckpt) is not None:
                raise ValueError(_quantized_gate(gate, "add 're:.*mlp.gate$' and "
                                                 "'re:.*shared_expert_gate$' to its ignore list"))
        return "compressed-tensors", ckpt
    if desc_path and os.path.isfile(desc_path):
        if quant_method not in (None, "ascend"):
            raise ValueError(f"{folder} has both {MODELSLIM_DESCRIPTION} and quantization_config "
                             f"quant_method {quant_method!r}; remove the one that does not "
                             "describe the weights")
        with open(desc_path) as f:
            description = validate_modelslim(_text_names(json.load(f)), desc_path)
        return "ascend", {"quant_method": "ascend", "description": description}
    if quant_method == "ascend":
        raise ValueError(f"config.json says quant_method 'ascend' but {folder or 'the model'} "
                         f"has no {MODELSLIM_DESCRIPTION}; copy it from the ModelSlim output")
    if ckpt is not None:
        raise ValueError(f"The checkpoint is quantized with {quant_method or 'an unnamed method'!r}"
                         ", which qwenserve cannot load; it loads INT8 W8A8 checkpoints "
                         "(compressed-tensors, Ascend ModelSlim), or quantizes a float checkpoint "
                         "while loading with --quantization int8")
    return None, None


def _text_names(desc: dict) -> dict:
    """A ModelSlim description keyed by the text model's names (``model.layers...``)."""
    return {_TEXT + k[len(_VLM_TEXT):] if k.startswith(_VLM_TEXT) else k: v
            for k, v in desc.items()}


def _reconcile(detected: str | None, requested: str | None) -> str | None:
    if requested is None:
        return detected
    if requested == "int8":
        if detected is not None:
            raise ValueError(f"--quantization int8 quantizes a float checkpoint while loading, "
                             f"but this is already {_DESCRIBED[detected]}; remove the flag (the "
                             f"method is detected) or pass --quantization {detected}")
        return "int8"
    if detected is None:
        raise ValueError(f"--quantization {requested} was given but the checkpoint is not "
                         "quantized (no quantization_config in config.json, no "
                         f"{MODELSLIM_DESCRIPTION}); remove the flag, or pass --quantization int8 "
                         "to quantize it while loading")
    if requested in (detected, "w8a8"):  # w8a8: whichever INT8 W8A8 format the checkpoint has
        return detected
    raise ValueError(f"--quantization {requested} contradicts the checkpoint, which is "
                     f"{_DESCRIBED[detected]}; pass --quantization {detected} or remove the flag")


def _as_dict(config: Any) -> dict | None:
    if config is None or isinstance(config, dict):
        return config
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


# ---- compressed-tensors --------------------------------------------------------------------------
def validate_compressed_tensors(cfg: dict) -> dict:
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        problems = _ct_group_problems(group, group.get("format") or cfg.get("format"))
        if problems:
            raise ValueError(
                f"compressed-tensors scheme {name!r} is not INT8 W8A8 with per-channel weights "
                f"and dynamic per-token activations ({'; '.join(problems)}); qwenserve runs that "
                "scheme only. Use such a checkpoint, or the float model with --quantization int8")
    extras = {"kv_cache_scheme": "KV-cache quantization", "transform_config": "transforms"}
    for key, what in extras.items():
        if cfg.get(key):
            raise ValueError(f"compressed-tensors {what} ({key}) are not supported; use a "
                             "checkpoint without them")
    sparsity = cfg.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not "
                         "supported; use a dense INT8 W8A8 checkpoint")
    if ct_scheme_for("lm_head", cfg) is not None:
        raise ValueError("this compressed-tensors checkpoint quantizes lm_head; qwenserve keeps "
                         "lm_head in float (llm-compressor's default ignore=['lm_head'])")
    return cfg


def _ct_group_problems(group: dict, fmt: str | None) -> list[str]:
    weights, acts = group.get("weights"), group.get("input_activations")
    problems = [] if fmt in CT_FORMATS else [f"format {fmt!r}, expected one of {CT_FORMATS}"]
    if not weights:
        problems.append("no weight quantization")
    else:
        problems += _arg_problems("weights", weights, strategy="channel", dynamic=False)
        if weights.get("group_size") or weights.get("actorder") or weights.get("block_structure"):
            problems.append("weights use groups, blocks or act-order")
    if not acts:
        problems.append("weight-only (no input_activations)")
    else:
        problems += _arg_problems("input_activations", acts, strategy="token", dynamic=True)
    if group.get("output_activations"):
        problems.append("output activations are quantized")
    return problems


def _arg_problems(what: str, args: dict, strategy: str, dynamic: bool) -> list[str]:
    expected = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": strategy,
                "dynamic": dynamic}
    actual = {"type": args.get("type", "int"), "num_bits": args.get("num_bits", 8),
              "symmetric": args.get("symmetric", True), "strategy": args.get("strategy"),
              "dynamic": args.get("dynamic", False)}
    return [f"{what} {key}={actual[key]!r}" for key in expected if actual[key] != expected[key]]


def ct_scheme_for(module: str, cfg: dict) -> dict | None:
    """The config group whose targets match ``module`` (a checkpoint module name), or None when it
    is ignored or untargeted. An exact name beats a ``re:`` pattern beats the class ``Linear``.
    Names are matched as the text model's and as a vision-language checkpoint's."""
    names = [module]
    if module.startswith(_TEXT):
        names.append(_VLM_TEXT + module[len(_TEXT):])
    if any(_ct_rank(pattern, name) for pattern in cfg.get("ignore") or [] for name in names):
        return None
    best, best_rank = None, 0
    for group in (cfg.get("config_groups") or {}).values():
        rank = max((_ct_rank(t, name) for t in group.get("targets") or [] for name in names),
                   default=0)
        if rank > best_rank:
            best, best_rank = group, rank
    return best


def _ct_rank(target: str, module: str) -> int:
    if target == module:
        return 3
    if target.startswith("re:"):
        return 2 if re.match(target[3:], module) else 0
    return 1 if target == "Linear" else 0  # every layer qwenserve quantizes is a Linear in HF


# ---- Ascend ModelSlim ----------------------------------------------------------------------------
def validate_modelslim(desc: dict, path: str) -> dict:
    types = {v for k, v in desc.items() if k.endswith(".weight") and isinstance(v, str)}
    unsupported = sorted(types - {"FLOAT", *MODELSLIM_LINEAR_TYPES})
    if unsupported:
        raise ValueError(f"{path}: quantization type(s) {unsupported} (model_quant_type "
                         f"{desc.get('model_quant_type')!r}); qwenserve runs ModelSlim W8A8 and "
                         "W8A8_DYNAMIC only: export with one of those, or use the float model")
    for key in _MODELSLIM_UNSUPPORTED_KEYS:
        if desc.get(key):
            raise ValueError(f"{path}: {key}={desc[key]!r} (KV-cache / attention quantization) is "
                             "not supported; export without it")
    norm_bias = [k for k in desc if re.search(r"norm\.(module\.)?bias$", k)]
    if norm_bias:
        raise ValueError(f"{path}: RMSNorm biases from anti-outlier suppression ({norm_bias[0]}, "
                         "...) are not supported; export with an anti-outlier method that leaves "
                         "the norms without bias, or without anti-outlier")
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if desc.get(name, "FLOAT") != "FLOAT":
            raise ValueError(f"{path}: {name} is quantized ({desc[name]}); qwenserve keeps the "
                             "embeddings and lm_head in float")
    for name, quant_type in desc.items():
        if not name.endswith(".weight") or quant_type == "FLOAT":
            continue
        if _MOE_GATES.search(name.removesuffix(".weight")):
            raise ValueError(f"{path}: " + _quantized_gate(name, "export with it FLOAT"))
        if quant_type == "W8A8" and (".experts." in name or ".shared_expert." in name):
            raise ValueError(f"{path}: {name} is a MoE expert with static W8A8 activations; "
                             "qwenserve runs MoE experts as W8A8_DYNAMIC (per-token activations, "
                             "what ModelSlim's MoE recipes write): export the experts with it")
    return desc


def _quantized_gate(name: str, fix: str) -> str:
    return (f"{name} (a MoE router or shared-expert gate) is quantized; qwenserve keeps these "
            f"gates in float, as vLLM does: {fix}")


def experts_quantized(method: str | None, config: dict | None) -> bool:
    """Whether a detected checkpoint stores INT8 MoE experts (for reports such as doctor's)."""
    if method == "compressed-tensors" and config is not None:
        return ct_scheme_for("model.layers.0.mlp.experts.0.gate_proj", config) is not None
    if method == "ascend" and config is not None:
        return any(".experts." in k and v != "FLOAT" for k, v in config["description"].items())
    return False


def expert_weight_names(prefix: str, num_experts: int) -> list[str]:
    """Checkpoint weight names of the experts at ``prefix``: ``...mlp.experts`` ->
    ``...experts.{e}.{gate,up,down}_proj.weight`` for every expert; a shared expert (any other
    prefix) -> ``...shared_expert.{gate,up,down}_proj.weight``."""
    if prefix.endswith(".experts"):
        return [f"{prefix}.{e}.{p}.weight" for e in range(num_experts)
                for p in _EXPERT_PROJECTIONS]
    return [f"{prefix}.{p}.weight" for p in _EXPERT_PROJECTIONS]


def modelslim_expert_type(prefix: str, num_experts: int, desc: dict) -> str | None:
    """"W8A8_DYNAMIC" for INT8 experts, None for float ones (or ones not listed). A layer's
    experts run as one stack, so all their projections must share one type."""
    types = {desc.get(name) or "FLOAT" for name in expert_weight_names(prefix, num_experts)}
    if len(types) > 1:
        raise ValueError(f"the experts of {prefix} are quantized differently "
                         f"({sorted(types)}); qwenserve runs a layer's experts as one stack, so "
                         "their gate/up/down projections must share one type")
    quant_type = types.pop()
    return None if quant_type == "FLOAT" else quant_type


def modelslim_type_for(prefix: str, desc: dict) -> str | None:
    """"W8A8" | "W8A8_DYNAMIC" for a quantized layer, None for a float one (or one not listed,
    as vLLM Ascend reads it). The shards of a merged layer must agree."""
    types = {desc.get(f"{name}.weight") for name in shard_names(prefix)}
    if len(types) > 1:
        raise ValueError(f"the shards of {prefix} ({', '.join(shard_names(prefix))}) are quantized "
                         f"differently ({sorted(map(str, types))}); qwenserve runs them as one "
                         "matrix, so they must share one type")
    quant_type = types.pop()
    return None if quant_type in (None, "FLOAT") else quant_type
