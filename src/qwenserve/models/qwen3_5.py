"""Qwen3.5 (dense and MoE): hybrid Gated DeltaNet + gated full attention (qwen_arch.md §3).

    layer_types: 3 of every 4 layers "linear_attention" (Gated DeltaNet), the 4th "full_attention"
    full attention: q_proj gives [q | gate] per head; zero-centred q/k norms; partial RoPE;
                    output * sigmoid(gate)
    Gated DeltaNet: in_proj -> causal conv (state: last K-1 inputs) -> delta rule (state S)
                    -> gated RMSNorm with z -> out_proj
    all RMSNorms outside the DeltaNet are zero-centred: x_hat * (1 + w)

Full-attention layers use the paged KV cache; DeltaNet layers use one state slot per sequence.
Checkpoints of the vision-language model nest the text model under ``model.language_model.``;
the vision tower (``model.visual.``) and the multi-token-prediction head (``mtp.``) are skipped
here; the head is loaded on its own (``qwen3_5_mtp.py``) when ``--speculative-config`` asks
for MTP.

Qwen3-Next (``Qwen3NextForCausalLM``) is the same network with two fused DeltaNet projections
whose rows are grouped per key head (``in_proj_qkvz``, ``in_proj_ba``); they are regrouped into
Qwen3.5's four matrices while loading (``split_qwen3_next_projections``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.core.cache.spec import CacheSpec, PagedKVSpec, RecurrentStateSpec
from qwenserve.layers.activation import sigmoid_gate
from qwenserve.layers.caches import ModelCaches, RecurrentState
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.linear import QKVParallelLinear, RowParallelLinear
from qwenserve.layers.moe import MoEBlock, is_moe_layer
from qwenserve.layers.norm import ZeroCenteredRMSNorm
from qwenserve.layers.recurrent import RMSNormGated
from qwenserve.layers.rotary import RotaryEmbedding
from qwenserve.logger import init_logger
from qwenserve.models.base import STACKED_PARAMS, ModelContext, kv_heads_per_rank
from qwenserve.models.dense import MLP, DecoderModel, DenseForCausalLM
from qwenserve.models.qwen3_5_layers import GDNInProj, sharded_parameter
from qwenserve.models.vision_language import VisionLanguageMixin

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = init_logger(__name__)

_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


def layer_types(cfg: PretrainedConfig) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(cfg, "full_attention_interval", 4) or 4
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg.num_hidden_layers)]


def partial_rotary_factor(cfg: PretrainedConfig) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor",
                            getattr(cfg, "partial_rotary_factor", 0.25) or 0.25))


class GatedAttention(nn.Module):
    """Full attention with a per-channel sigmoid output gate (q_proj holds [q | gate] per head)."""

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=bool(getattr(cfg, "attention_bias", False)), dtype=ctx.dtype, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.qkv_proj"), q_head_multiplier=2)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
            bias=bool(getattr(cfg, "attention_bias", False)), dtype=ctx.dtype, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.o_proj"))
        fused = self.elementwise = ctx.backends.elementwise
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.dtype, fused)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.dtype, fused)
        self.backend = ctx.backends.attention

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        qg = qg.view(n, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]  # strided views of the projection: no copies
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d))
        q, k = rotary(positions, q, k)
        v = v.reshape(n, self.num_kv_heads, d)
        o = self.backend.forward(q, k, v, kv_cache, batch.attn, d**-0.5)
        return self.o_proj(sigmoid_gate(o.view(n, self.num_heads, d), gate, self.elementwise))


class GatedDeltaNet(nn.Module):
    """Linear attention with a fixed-size state; heads split over tensor-parallel ranks."""

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg, tp = ctx.hf_config, ctx.tp
        self.num_k_heads = tp.shard(cfg.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = tp.shard(cfg.linear_num_value_heads, "linear_num_value_heads")
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.in_proj = GDNInProj(ctx, f"{prefix}.in_proj")
        self.conv_dim = self.in_proj.conv_dim  # per rank
        kernel = cfg.linear_conv_kernel_dim
        self.conv1d = self.in_proj.make_conv_weight(kernel)  # [conv_dim, K]
        self.dt_bias = sharded_parameter(cfg.linear_num_value_heads, tp, torch.float32)
        self.A_log = sharded_parameter(cfg.linear_num_value_heads, tp, torch.float32)
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps, ctx.dtype, ctx.backends.recurrent)
        self.norm.weight.requires_grad_(False)
        self.out_proj = RowParallelLinear(
            cfg.linear_num_value_heads * self.dv, cfg.hidden_size, dtype=ctx.dtype, tp=tp,
            quant_method=ctx.linear_method(f"{prefix}.out_proj"))
        self.backend = ctx.backends.recurrent

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: RecurrentState
                ) -> torch.Tensor:
        assert batch.state is not None, "the model runner builds GDN metadata for this model"
        conv_state, ssm_state = state.conv, state.ssm
        n = x.shape[0]
        mixed, z, b, a = self.in_proj(x)
        mixed = self.backend.causal_conv1d(mixed, self.conv1d.weight, None, conv_state, batch.state)
        kd = self.num_k_heads * self.dk
        q, k, v = mixed.split([kd, kd, self.num_v_heads * self.dv], dim=-1)
        g, beta = self.backend.gating(a, b, self.A_log, self.dt_bias)
        o = self.backend.gated_delta_rule(
            q.reshape(n, self.num_k_heads, self.dk), k.reshape(n, self.num_k_heads, self.dk),
            v.reshape(n, self.num_v_heads, self.dv), g, beta, ssm_state, batch.state)
        o = self.norm(o, z.view(n, self.num_v_heads, self.dv))  # z: a strided view, no copy
        return self.out_proj(o.reshape(n, self.num_v_heads * self.dv))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, layer_id: int, kind: str, mlp: nn.Module) -> None:
        super().__init__()
        cfg = ctx.hf_config
        prefix = f"model.layers.{layer_id}"
        self.layer_id = layer_id
        self.is_full = kind == "full_attention"
        if self.is_full:
            self.self_attn = GatedAttention(ctx, f"{prefix}.self_attn")
        else:
            self.linear_attn = GatedDeltaNet(ctx, f"{prefix}.linear_attn")
        self.mlp = mlp
        fused = ctx.backends.elementwise
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype,
                                                   fused)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                            ctx.dtype, fused)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch, caches: ModelCaches, rotary: RotaryEmbedding):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.is_full:
            x = self.self_attn(positions, x, batch, caches.kv[self.layer_id], rotary)
        else:
            x = self.linear_attn(x, batch, caches.state[self.layer_id])
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5ForCausalLM(DenseForCausalLM):
    """Text model of Qwen3.5 / Qwen3.5-MoE (also serves the ``...ForConditionalGeneration``
    checkpoints, whose text weights sit under ``model.language_model.``): the shared causal LM
    with hybrid layers, zero-centred norms and partial RoPE."""

    # Qwen3.5-MoE's router always renormalizes its top-k weights; None: the config's
    # ``norm_topk_prob`` decides (Qwen3-Next).
    moe_renormalize: bool | None = True
    stacked_params = (*STACKED_PARAMS, ("in_proj", "in_proj_qkv", "qkv"),
                      ("in_proj", "in_proj_z", "z"), ("in_proj", "in_proj_b", "b"),
                      ("in_proj", "in_proj_a", "a"))

    def __init__(self, ctx: ModelContext) -> None:
        cfg = ctx.hf_config
        if getattr(cfg, "attn_output_gate", True) is False:
            raise ValueError("Qwen3.5 checkpoints with attn_output_gate=false are not supported")
        super().__init__(ctx)
        self.dtype = ctx.dtype
        self.ssm_dtype = ctx.ssm_dtype  # the recurrent state's; kernels compute in fp32
        self.config = cfg

    def make_decoder(self, ctx: ModelContext) -> DecoderModel:
        cfg, types = ctx.hf_config, layer_types(ctx.hf_config)
        return DecoderModel(
            ctx, lambda i: Qwen3_5DecoderLayer(ctx, i, types[i], self.make_mlp(ctx, i)),
            norm=ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype,
                                     ctx.backends.elementwise),
            rotary=RotaryEmbedding(cfg, cfg.head_dim,
                                   int(cfg.head_dim * partial_rotary_factor(cfg)),
                                   ctx.max_model_len, ctx.backends.elementwise))

    def make_mlp(self, ctx: ModelContext, layer_id: int, prefix: str | None = None) -> nn.Module:
        """``prefix``: the block's checkpoint name where it is not ``model.layers.{layer_id}.mlp``
        (the MTP head's ``mtp.layers.0.mlp``): quantization configs are looked up by it."""
        cfg = ctx.hf_config
        if is_moe_layer(cfg, layer_id):
            mlp = prefix or f"model.layers.{layer_id}.mlp"
            return MoEBlock(cfg, ctx.dtype, ctx.tp, cfg.shared_expert_intermediate_size,
                            renormalize=self.moe_renormalize,
                            expert_parallel=ctx.expert_parallel, dp_ep=ctx.dp_ep,
                            method=ctx.expert_method(f"{mlp}.experts", cfg.num_experts),
                            shared_method=ctx.expert_method(f"{mlp}.shared_expert"))
        return MLP(ctx, cfg.intermediate_size, False, f"model.layers.{layer_id}.mlp")

    @classmethod
    def cache_specs(cls, hf_config: PretrainedConfig, tp_size: int, kv_dtype_bytes: int,
                    ssm_dtype_bytes: int = 4) -> list[CacheSpec]:
        cfg, types = hf_config, layer_types(hf_config)
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
        linear = tuple(i for i, t in enumerate(types) if t != "full_attention")
        conv_dim = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                    + cfg.linear_num_value_heads * cfg.linear_value_head_dim) // tp_size
        ssm = (cfg.linear_num_value_heads // tp_size) * cfg.linear_key_head_dim \
            * cfg.linear_value_head_dim * ssm_dtype_bytes  # --mamba-ssm-cache-dtype
        return [
            PagedKVSpec(full, kv_heads_per_rank(cfg.num_key_value_heads, tp_size), cfg.head_dim,
                        kv_dtype_bytes),
            RecurrentStateSpec(linear, (cfg.linear_conv_kernel_dim - 1) * conv_dim
                               * kv_dtype_bytes, ssm),
        ]

    @classmethod
    def mtp_cache_specs(cls, hf_config: PretrainedConfig, tp_size: int, kv_dtype_bytes: int
                        ) -> list[CacheSpec]:
        """The MTP head's paged KV layer (``--speculative-config`` method mtp)."""
        from qwenserve.models.qwen3_5_mtp import mtp_cache_spec

        return [mtp_cache_spec(hf_config, tp_size, kv_dtype_bytes)]

    def make_mtp_head(self, ctx: ModelContext) -> nn.Module:
        """The checkpoint's multi-token-prediction head, sharing this model's embedding,
        rotary embedding and LM head (``models/qwen3_5_mtp.py``)."""
        from qwenserve.models.qwen3_5_mtp import Qwen3_5MTP

        return Qwen3_5MTP(ctx, self)

    def allocate_state(self, num_state_slots: int, device: torch.device
                       ) -> list[RecurrentState]:
        """Per Gated DeltaNet layer: conv [slots, K-1, conv_dim] and ssm [slots, Hv, Dk, Dv]."""
        states = []
        for layer in self.model.layers:
            if layer.is_full:
                continue
            gdn = layer.linear_attn
            kernel = gdn.conv1d.weight.shape[1]
            conv = torch.zeros(num_state_slots, kernel - 1, gdn.conv_dim, dtype=self.dtype,
                               device=device)
            ssm = torch.zeros(num_state_slots, gdn.num_v_heads, gdn.dk, gdn.dv,
                              dtype=self.ssm_dtype, device=device)
            states.append(RecurrentState(conv, ssm))
        return states

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        return split_qwen3_next_projections(_text_weights(weights), self.config)


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterable[tuple[str, torch.Tensor]]:
    """Strip the VLM nesting, rename the conv weight, and drop vision/MTP tensors (logged)."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(_SKIPPED_PREFIXES):
            skipped += 1
            continue
        name = name.replace("model.language_model.", "model.", 1)
        if name.endswith("linear_attn.conv1d.weight"):
            tensor = tensor.reshape(tensor.shape[0], -1)  # [conv_dim, 1, K] -> [conv_dim, K]
        yield name, tensor
    if skipped:
        logger.info("Skipped %d vision-tower / MTP tensors (not needed to serve text)", skipped)


def split_qwen3_next_projections(weights: Iterable[tuple[str, torch.Tensor]], cfg: PretrainedConfig
                                 ) -> Iterable[tuple[str, torch.Tensor]]:
    """Qwen3-Next's ``in_proj_qkvz`` rows are [q | k | v | z] per key head (v and z holding that
    head's Hv/Hk value heads) and ``in_proj_ba`` rows [b | a] per key head; regroup them into
    Qwen3.5's ``in_proj_qkv`` ([all q | all k | all v]), ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``. Value heads keep their order (key head major), as transformers reads them."""
    for name, tensor in weights:
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            group_v = cfg.linear_num_value_heads // hk * dv
            q, k, v, z = tensor.reshape(hk, 2 * dk + 2 * group_v, -1).split(
                [dk, dk, group_v, group_v], dim=1)  # each [Hk, rows, hidden]
            base = name[: -len("in_proj_qkvz.weight")]
            yield base + "in_proj_qkv.weight", torch.cat(
                [q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hk * group_v, -1)])
            yield base + "in_proj_z.weight", z.reshape(hk * group_v, -1)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            hk = cfg.linear_num_key_heads
            group = cfg.linear_num_value_heads // hk
            b, a = tensor.reshape(hk, 2 * group, -1).split([group, group], dim=1)
            base = name[: -len("in_proj_ba.weight")]
            yield base + "in_proj_b.weight", b.reshape(hk * group, -1)
            yield base + "in_proj_a.weight", a.reshape(hk * group, -1)
        else:
            yield name, tensor


class Qwen3_5ForConditionalGeneration(VisionLanguageMixin, Qwen3_5ForCausalLM):
    """The published VLM checkpoints: the text model plus the vision tower and M-RoPE
    (``models/vision_language.py``); text only with ``--language-model-only``."""


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (e.g. Qwen3-Next-80B-A3B): fused DeltaNet projections in the checkpoint, MoE
    layers placed by ``decoder_sparse_step`` / ``mlp_only_layers``, ``norm_topk_prob`` honoured."""

    moe_renormalize = None


Qwen3_5MoeForCausalLM = Qwen3_5ForCausalLM
Qwen3_5MoeForConditionalGeneration = Qwen3_5ForConditionalGeneration
