"""The planner's arithmetic: weights counted on a meta-device model, cache from core/cache/plan.

Building the model on PyTorch's meta device gives every parameter's exact per-rank shape (tensor
parallel sharding, tied embeddings counted once, MoE experts, Qwen3.5 layers) without allocating
memory, so the weight figure is the engine's own, not a formula that can drift from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from qwenserve.core.cache.plan import (
    CachePlan,
    CacheTooSmallError,
    largest_max_model_len,
    plan_cache,
)
from qwenserve.core.cache.spec import CacheSpec, PagedKVSpec, RecurrentStateSpec
from qwenserve.tools.plan.devices import QUANT_GROUP_OVERHEAD, QUANT_WIDTHS

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class PlanInputs:
    hf_config: Any
    architecture: str
    dtype: str
    tp: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    quantization: str | None = None
    kv_dtype_bytes: int | None = None
    ssm_dtype_bytes: int = 4  # --mamba-ssm-cache-dtype
    expert_parallel: bool = False  # --enable-expert-parallel: rank 0 holds the most experts
    mtp: bool = False  # --speculative-config method mtp: the head's weights and KV layer
    eagle3: Any = None  # method eagle3: the head's config (its weights and KV layer)


@dataclass
class RankPlan:
    """One device's figures at a given tensor-parallel size."""

    tp: int
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    activation_bytes: int
    budget_bytes: int
    cache: CachePlan | None
    error: str | None = None
    largest_max_model_len: int = 0
    details: dict = field(default_factory=dict)


def cache_specs(inputs: PlanInputs) -> list[CacheSpec]:
    """The engine's specs; ``--kv-cache-dtype`` narrows K/V only (DeltaNet's conv state stays
    in the model dtype, its SSM state in ``--mamba-ssm-cache-dtype``, float32 by default)."""
    from qwenserve.models.registry import load_model_class

    model_bytes = _DTYPE_BYTES[inputs.dtype]
    model_cls = load_model_class(inputs.architecture)
    specs = model_cls.cache_specs(inputs.hf_config, inputs.tp, model_bytes,
                                  inputs.ssm_dtype_bytes)
    if inputs.mtp:  # the MTP head's attention: one more paged KV layer
        if not hasattr(model_cls, "mtp_cache_specs"):
            raise ValueError(f"--speculative-config method mtp: {inputs.architecture} has no "
                             "multi-token-prediction head in qwenserve")
        specs = specs + model_cls.mtp_cache_specs(inputs.hf_config, inputs.tp, model_bytes)
    if inputs.eagle3 is not None:  # the EAGLE-3 head's attention, likewise
        from qwenserve.models.eagle3 import eagle3_cache_spec

        specs = specs + [eagle3_cache_spec(inputs.eagle3, inputs.hf_config.num_hidden_layers,
                                           inputs.tp, model_bytes)]
    kv_bytes = inputs.kv_dtype_bytes or model_bytes
    return [replace(s, dtype_bytes=kv_bytes) if isinstance(s, PagedKVSpec) else s for s in specs]


def weight_bytes(inputs: PlanInputs) -> tuple[int, dict]:
    """Bytes of one rank's parameters and buffers, linear weights at the quantized width."""
    import torch

    from qwenserve import envs
    from qwenserve.distributed.parallel_group import ParallelGroup
    from qwenserve.layers.embedding import VocabParallelEmbedding
    from qwenserve.layers.linear import LinearBase
    from qwenserve.models.base import ModelContext
    from qwenserve.models.registry import load_model_class

    dtype = getattr(torch, inputs.dtype)
    ctx = ModelContext(hf_config=inputs.hf_config, dtype=dtype,
                       max_model_len=inputs.max_model_len,
                       tp=ParallelGroup(rank=0, world_size=inputs.tp),
                       expert_parallel=inputs.expert_parallel)
    with torch.device("meta"):
        model = load_model_class(inputs.architecture)(ctx)
        head = _speculative_head(inputs, ctx, model)
    # Linear weight matrices take the quantized width; norms and MoE routers stay in the model
    # dtype. Load-time int8 is the engine's own: MoE experts stay float, the embedding and
    # lm_head tables become int8. Checkpoint formats (w8a8, fp8, awq, gptq) quantize experts.
    quantizable = {id(m.weight) for m in model.modules()
                   if isinstance(m, LinearBase) and getattr(m, "weight", None) is not None}
    if inputs.quantization != "int8":
        quantizable |= {id(p) for n, p in model.named_parameters()
                        if n.rsplit(".", 1)[-1] in ("w13", "w2")}
    if inputs.quantization == "int8" and not envs.int8_float_vocab():
        quantizable |= {id(m.weight) for m in model.modules()
                        if isinstance(m, VocabParallelEmbedding)}
    # The vision tower runs in the model dtype whatever the quantization (as the engine loads it).
    tower = getattr(model, "visual", None)
    vision = {id(t) for t in tower.parameters()} if tower is not None else set()
    width = QUANT_WIDTHS.get(inputs.quantization)
    overhead = QUANT_GROUP_OVERHEAD.get(inputs.quantization, 0.0)
    seen: set[int] = set()
    totals = {"linear": 0, "other": 0, "scales": 0, "vision": 0, "speculative_head": 0}
    # The head's own tensors, unquantized as the engine loads them (shared ones count once,
    # with the target's).
    head_tensors = set() if head is None else {
        id(t) for t in [*head.parameters(), *head.buffers()]} - {
        id(t) for t in [*model.parameters(), *model.buffers()]}
    modules = [model] + ([head] if head is not None else [])
    for tensor in [t for m in modules for t in [*m.parameters(), *m.buffers()]]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in head_tensors:
            totals["speculative_head"] += tensor.numel() * tensor.element_size()
        elif id(tensor) in vision:
            totals["vision"] += tensor.numel() * tensor.element_size()
        elif id(tensor) in quantizable:
            if width is None:
                totals["linear"] += tensor.numel() * tensor.element_size()
            else:  # plus one fp32 scale per output channel
                totals["linear"] += int(tensor.numel() * (width + overhead))
                totals["scales"] += tensor.numel() // tensor.shape[-1] * 4
        else:
            totals["other"] += tensor.numel() * tensor.element_size()
    return sum(totals.values()), totals


def _speculative_head(inputs: PlanInputs, ctx: Any, model: Any) -> Any:
    """The MTP or EAGLE-3 head as the engine builds it: sharded over ``inputs.tp`` ranks like
    the target (one rank's share)."""
    if inputs.mtp:
        return model.make_mtp_head(ctx)
    if inputs.eagle3 is None:
        return None
    from qwenserve.models.eagle3 import Eagle3Head

    head_ctx = replace(ctx, hf_config=inputs.eagle3)
    return Eagle3Head(head_ctx, model.model, inputs.hf_config.num_hidden_layers,
                      inputs.hf_config.hidden_size)


def activation_bytes(inputs: PlanInputs) -> int:
    """Estimated peak activations of one step at the full token budget (the engine measures
    the real figure with a profiling forward pass at start-up)."""
    cfg = inputs.hf_config
    tokens = inputs.max_num_batched_tokens
    act = _DTYPE_BYTES[inputs.dtype]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim // inputs.tp
    inter = getattr(cfg, "intermediate_size", None) or 0
    moe = (getattr(cfg, "moe_intermediate_size", 0) or 0) * (
        getattr(cfg, "num_experts_per_tok", 0) or 0)
    mlp = 3 * max(inter, moe) // inputs.tp
    per_token = (4 * cfg.hidden_size + qkv + mlp) * act
    logits = inputs.max_num_seqs * cfg.vocab_size * 4 * 3  # fp32 logits, probs, sort buffer
    return int(tokens * per_token * 2 + logits) + vision_activation_bytes(inputs)


def vision_activation_bytes(inputs: PlanInputs) -> int:
    """Peak activations of the vision tower on the largest image one step may encode.

    The encoder budget (core/encoder_budget.py) is the token budget, in language-model tokens,
    so one step encodes at most ``max_num_batched_tokens x merge^2`` patches. Per patch a block
    holds the hidden state, q/k/v, the attention output and the MLP's hidden layer (split over
    ranks by heads), twice for the residual stream; memory-efficient attention kernels keep no
    [patches x patches] score matrix. The tower's tokens then sit in the encoder cache.
    """
    vision = getattr(inputs.hf_config, "vision_config", None)
    if vision is None:
        return 0
    act = _DTYPE_BYTES[inputs.dtype]
    patches = inputs.max_num_batched_tokens * vision.spatial_merge_size**2
    hidden, inter = vision.hidden_size, vision.intermediate_size
    per_patch = (4 * hidden + (3 * hidden + hidden + inter) // inputs.tp) * act
    cache = inputs.max_num_batched_tokens * vision.out_hidden_size * act * (
        1 + len(getattr(vision, "deepstack_visual_indexes", None) or []))
    return int(patches * per_patch * 2 + cache)


def plan_rank(inputs: PlanInputs, budget_for: Any) -> RankPlan:
    """``budget_for(weight_bytes, activation_bytes) -> KV budget`` depends on the device."""
    specs = cache_specs(inputs)
    weights, details = weight_bytes(inputs)
    activation = activation_bytes(inputs)
    budget = budget_for(weights, activation)
    per_token = sum(s.bytes_per_token for s in specs if isinstance(s, PagedKVSpec))
    per_seq = sum(s.bytes_per_seq for s in specs if isinstance(s, RecurrentStateSpec))
    result = RankPlan(inputs.tp, weights, per_token, per_seq, activation, budget, None,
                      details=details)
    result.largest_max_model_len = (
        largest_max_model_len(specs, budget, inputs.block_size, inputs.max_num_seqs)
        if budget > 0 else 0)
    if budget <= 0:
        result.error = (f"the weights ({weights / 2**30:.1f} GiB) and activations "
                        f"({activation / 2**30:.1f} GiB) leave no memory for the KV cache")
        return result
    try:
        result.cache = plan_cache(specs, budget, inputs.block_size, inputs.max_num_seqs,
                                  inputs.max_model_len)
    except CacheTooSmallError as e:
        result.error = str(e)
    return result
