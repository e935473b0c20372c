"""The dense decoder shared by Llama, Qwen2/2.5 and Qwen3 (research/qwen_arch.md §0-2).

    x = embed(ids)
    per layer:  h = x + o_proj(attn(rope(qk_norm?(q, k)), v));  x = h + down(silu(gate) * up)
    logits = lm_head(norm(x))                  (lm_head tied to embed when tie_word_embeddings)

The architectures differ only in switches: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3).
``DenseForCausalLM`` is also the base of the MoE and hybrid models: they override its factories
(``make_mlp``, ``make_decoder``) and keep its forward, LM head, tying and weight loading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qwenserve.core.cache.spec import CacheSpec, PagedKVSpec
from qwenserve.layers.activation import silu_and_mul
from qwenserve.layers.caches import ModelCaches, RecurrentState
from qwenserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from qwenserve.layers.moe import SparseMoeBlock
from qwenserve.layers.norm import RMSNorm
from qwenserve.layers.rotary import RotaryEmbedding
from qwenserve.models.base import (
    STACKED_PARAMS,
    ModelContext,
    check_all_loaded,
    config_head_dim,
    kv_heads_per_rank,
    load_named_weights,
    split_module_weights,
)
from qwenserve.quantization.methods import int8_mlp

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
            fused = ctx.backends.elementwise
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.dtype, fused)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx.dtype, fused)
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
        o = self.backend.forward(q, k, v, kv_cache, batch.attn, self.scale)
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
        self.fused = ctx.backends.elementwise
        self.row_chunk = ctx.backends.mlp_row_chunk
        # gate_up and SiLU-and-mul in one kernel, for the plain (unquantized) weight only
        unquantized = isinstance(self.gate_up_proj.quant_method, UnquantizedLinearMethod)
        self.gate_up_silu = ctx.backends.gate_up_silu if unquantized else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not 0 < self.row_chunk < x.shape[0]:
            return self._rows(x)
        out = torch.empty(*x.shape[:-1], self.down_proj.output_size, dtype=x.dtype,
                          device=x.device)
        for start in range(0, x.shape[0], self.row_chunk):
            rows = slice(start, start + self.row_chunk)
            out[rows] = self._rows(x[rows])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        fused = int8_mlp(self.gate_up_proj, self.down_proj, x)  # W8A8 only
        if fused is not None:
            return fused
        if self.gate_up_silu is not None:
            h = self.gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if h is not None:
                return self.down_proj(h)
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


class DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, switches: DenseSwitches, layer_id: int,
                 mlp: nn.Module) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.layer_id = layer_id
        self.self_attn = Attention(ctx, switches, f"model.layers.{layer_id}.self_attn")
        self.mlp = mlp
        fused = ctx.backends.elementwise
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype,
                                                fused)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch, caches: ModelCaches, rotary: RotaryEmbedding):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch, caches.kv[self.layer_id], rotary)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, the layers (each picks its own cache from ``caches``), final norm. The norm
    and the rotary embedding are the architecture's (Qwen3.5: zero-centred, partial RoPE)."""

    def __init__(self, ctx: ModelContext, make_layer: Callable[[int], nn.Module],
                 norm: nn.Module | None = None, rotary: RotaryEmbedding | None = None) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                                                   ctx.tp)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        if norm is None:
            norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.backends.elementwise)
        if rotary is None:
            head_dim = config_head_dim(cfg)
            rotary = RotaryEmbedding(cfg, head_dim, head_dim, ctx.max_model_len,
                                     ctx.backends.elementwise)
        self.norm, self.rotary = norm, rotary
        # EAGLE-3: the layers whose input hidden states the head reads (empty: none kept).
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None  # [T, len(ids) * H], the last forward's

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        return self.run_layers(self.embed_tokens(input_ids), positions, batch, caches)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                   caches: ModelCaches) -> torch.Tensor:
        """The layers and the final norm from the token embeddings ``x`` (the part of the
        forward a decode step records: worker/decode_replay.py)."""
        residual = None
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, batch, caches, self.rotary)
        if aux:
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1)
        x, _ = self.norm(x, residual)
        return x


class DenseForCausalLM(nn.Module):
    """The shared causal LM: a ``DecoderModel``, the LM head (tied to the embedding when
    ``tie_word_embeddings``) and the weight loading. Architectures override what differs:
    ``switches`` (dense variants), ``make_mlp`` (MoE), ``make_decoder`` (other layer kinds)."""

    # (parameter name fragment, checkpoint name fragment, shard id) of merged projections
    stacked_params: tuple[tuple[str, str, Any], ...] = STACKED_PARAMS

    @classmethod
    def switches(cls, hf_config: PretrainedConfig) -> DenseSwitches:
        raise NotImplementedError

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = self.make_decoder(ctx)
        self.lm_head = self.make_lm_head(ctx)

    def make_lm_head(self, ctx: ModelContext) -> nn.Module | None:
        """The vocabulary projection (None for models that score tokens with a head of their
        own, e.g. reward models)."""
        cfg = ctx.hf_config
        return ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype, ctx.tp,
                              tie_to=self.model.embed_tokens if self.tie else None,
                              float_linear=ctx.backends.float_linear,
                              greedy_head=ctx.backends.greedy_head)

    def make_decoder(self, ctx: ModelContext) -> DecoderModel:
        switches = self.switches(ctx.hf_config)
        return DecoderModel(ctx, lambda i: DecoderLayer(ctx, switches, i, self.make_mlp(ctx, i)))

    def make_mlp(self, ctx: ModelContext, layer_id: int) -> nn.Module:
        """Layer ``layer_id``'s feed-forward block (dense here; MoE models override)."""
        cfg = ctx.hf_config
        return MLP(ctx, cfg.intermediate_size, self.switches(cfg).mlp_bias,
                   f"model.layers.{layer_id}.mlp")

    @classmethod
    def cache_specs(cls, hf_config: PretrainedConfig, tp_size: int, kv_dtype_bytes: int,
                    ssm_dtype_bytes: int = 4) -> list[CacheSpec]:
        return [PagedKVSpec(
            layer_ids=tuple(range(hf_config.num_hidden_layers)),
            num_kv_heads=kv_heads_per_rank(hf_config.num_key_value_heads, tp_size),
            head_dim=config_head_dim(hf_config),
            dtype_bytes=kv_dtype_bytes,
        )]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        return self.model(input_ids, positions, batch, caches)

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None if self.lm_head is None else self.lm_head.greedy_tokens(hidden)

    def allocate_state(self, num_state_slots: int, device: torch.device
                       ) -> list[RecurrentState]:
        """No recurrent layers: no state pools (hybrid models override)."""
        return []

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under this model's names (renamed or regrouped here)."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        # MoE blocks load their stacked experts themselves.
        blocks = {f"model.layers.{i}.mlp.": layer.mlp for i, layer in
                  enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}
        loaded: set[str] = set()
        skip = ("rotary_emb.inv_freq", "lm_head.weight") if self.tie else ("rotary_emb.inv_freq",)
        rest = split_module_weights(self.checkpoint_weights(weights), blocks, loaded)
        loaded |= load_named_weights(self, rest, stacked=self.stacked_params, skip=skip)
        check_all_loaded(self, loaded, source)
