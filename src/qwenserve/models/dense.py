"""The dense decoder shared by Llama, Qwen2/2.5 and Qwen3 (research/qwen_arch.md §0-2).

    x = embed(ids)
    per layer:  h = x + o_proj(attn(rope(qk_norm?(q, k)), v));  x = h + down(silu(gate) * up)
    logits = lm_head(norm(x))                  (lm_head tied to embed when tie_word_embeddings)

The architectures differ only in switches: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qwenserve.core.cache.spec import CacheSpec, PagedKVSpec
from qwenserve.layers.activation import silu_and_mul
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from qwenserve.layers.norm import RMSNorm
from qwenserve.layers.rotary import RotaryEmbedding
from qwenserve.models.base import (
    ModelContext,
    check_all_loaded,
    config_head_dim,
    kv_heads_per_rank,
    load_named_weights,
)


@dataclass(frozen=True)
class DenseSwitches:
    """How an architecture differs from the common decoder."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


class Attention(nn.Module):
    def __init__(self, ctx: ModelContext, switches: DenseSwitches, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.head_dim = config_head_dim(cfg)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=switches.qkv_bias, dtype=ctx.dtype, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=switches.o_bias,
            dtype=ctx.dtype, tp=ctx.tp, quant_method=ctx.linear_method(f"{prefix}.o_proj"))
        if switches.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.dtype)
        self.qk_norm = switches.qk_norm
        self.scale = self.head_dim**-0.5
        self.backend = ctx.backends.attention

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                kv_cache: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = self.backend.forward(q, k, v.contiguous(), kv_cache, batch.attn, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, ctx: ModelContext, intermediate_size: int, bias: bool, prefix: str):
        super().__init__()
        hidden = ctx.hf_config.hidden_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate_size] * 2, bias=bias, dtype=ctx.dtype, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden, bias=bias, dtype=ctx.dtype, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, switches: DenseSwitches, prefix: str,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = Attention(ctx, switches, f"{prefix}.self_attn")
        self.mlp = mlp or MLP(ctx, cfg.intermediate_size, switches.mlp_bias, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch, kv_cache: torch.Tensor, rotary: RotaryEmbedding):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch, kv_cache, rotary)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, ctx: ModelContext, make_layer) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                                                   ctx.tp)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        head_dim = config_head_dim(cfg)
        self.rotary = RotaryEmbedding(cfg, head_dim, head_dim, ctx.max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, batch, caches.kv[i], self.rotary)
        x, _ = self.norm(x, residual)
        return x


class DenseForCausalLM(nn.Module):
    """Base of the dense architectures; subclasses set ``switches(hf_config)``."""

    @classmethod
    def switches(cls, hf_config: Any) -> DenseSwitches:
        raise NotImplementedError

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        switches = self.switches(ctx.hf_config)
        self.tie = bool(getattr(ctx.hf_config, "tie_word_embeddings", False))
        self.model = DecoderModel(
            ctx, lambda i: DecoderLayer(ctx, switches, f"model.layers.{i}"))
        self.lm_head = ParallelLMHead(ctx.hf_config.vocab_size, ctx.hf_config.hidden_size,
                                      ctx.dtype, ctx.tp,
                                      tie_to=self.model.embed_tokens if self.tie else None,
                                      float_linear=ctx.backends.float_linear)

    @classmethod
    def cache_specs(cls, hf_config: Any, tp_size: int, kv_dtype_bytes: int) -> list[CacheSpec]:
        return [PagedKVSpec(
            layer_ids=tuple(range(hf_config.num_hidden_layers)),
            num_kv_heads=kv_heads_per_rank(hf_config.num_key_value_heads, tp_size),
            head_dim=config_head_dim(hf_config),
            dtype_bytes=kv_dtype_bytes,
        )]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        return self.model(input_ids, positions, batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        skip = ("rotary_emb.inv_freq", "lm_head.weight") if self.tie else ("rotary_emb.inv_freq",)
        loaded = load_named_weights(self, weights, skip=skip)
        check_all_loaded(self, loaded, source)
