"""An EAGLE-3 draft head (``LlamaForCausalLMEagle3`` checkpoints) drafting for a Qwen3 target.

One Llama decoder layer that reads three of the target's intermediate hidden states (research:
vLLM's llama_eagle3.py and spec_decode/eagle.py; the wiring, not the code):

    g = fc(cat([a_1, a_2, a_3]))        the target's hidden states entering its layers
                                        aux_layer_ids (default 2, L/2, L-3); fc: [H, 3 Ht]
                                        (on later draft steps g is the head's previous ``p``)
    e = embed(t[i+1])                   the target's embedding unless the head ships one
    x = attn(cat([input_layernorm(e), hidden_norm(g)]), position i)     q/k/v read 2H
    r = x + g                           (+ hidden_norm(g) instead with norm_before_residual)
    p = mlp(post_attention_layernorm(r)) + r                            -> the next step's g
    logits = lm_head(norm(p))           over the head's draft vocabulary; draft id d is target
                                        id d + d2t[d]

Tensors: ``fc``, ``midlayer.*`` (``layers.0.*`` in some exports), ``norm``, ``lm_head``,
``d2t``/``t2d`` (absent when the draft vocabulary is the target's), ``embed_tokens`` (optional).
The head's attention KV is one more paged layer of the target's cache (id ``num_hidden_layers``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.core.cache.spec import PagedKVSpec
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.embedding import VocabParallelEmbedding
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.linear import QKVParallelLinear, ReplicatedLinear, UnquantizedLinearMethod
from qwenserve.layers.norm import RMSNorm
from qwenserve.layers.rotary import RotaryEmbedding
from qwenserve.models.base import (
    STACKED_PARAMS,
    ModelContext,
    check_all_loaded,
    config_head_dim,
    kv_heads_per_rank,
    load_named_weights,
)
from qwenserve.models.dense import MLP, Attention, DecoderModel, DenseSwitches
from qwenserve.models.loader import iter_safetensors, safetensors_files
from qwenserve.models.source import resolve_source

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Eagle3HeadConfig:
    folder: str
    hf_config: PretrainedConfig


def load_eagle3_config(model: str | None, target_config: PretrainedConfig) -> Eagle3HeadConfig:
    """The head's folder (a path or hub id) and config, checked against the target's."""
    import transformers

    source = resolve_source(model)
    if source.is_gguf:
        raise ValueError(f"EAGLE-3 head {model}: a .gguf file; pass the head's folder "
                         "(config.json + weights)")
    hf_config = transformers.AutoConfig.from_pretrained(source.folder)
    archs = getattr(hf_config, "architectures", None) or []
    if not any("Eagle3" in a for a in archs):
        raise ValueError(f"--speculative-config method eagle3: {model} is a {archs or 'model'} "
                         "checkpoint, not an EAGLE-3 head (LlamaForCausalLMEagle3); for a small "
                         'model with the same tokenizer use "method": "draft_model"')
    for key in ("speculators_config", "norm_before_fc", "fc_norm"):
        if getattr(hf_config, key, None):
            raise ValueError(f"EAGLE-3 head {model}: config.json's {key!r} (a speculators-format "
                             "or fc-norm head) is not implemented in qwenserve; use a head in "
                             "the original EAGLE-3 layout (LlamaForCausalLMEagle3)")
    check_head_fits(hf_config, target_config, model or source.folder)
    return Eagle3HeadConfig(source.folder, hf_config)


def iter_head_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors, or the ``pytorch_model.bin`` most published heads ship (tensors only)."""
    path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(path) and not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()
    else:
        yield from iter_safetensors(safetensors_files(folder))


def eagle3_aux_layer_ids(head_config: PretrainedConfig, num_target_layers: int
                         ) -> tuple[int, ...]:
    """The target layers whose input hidden states feed the head: the head config's
    ``eagle_aux_hidden_state_layer_ids`` (top level, as vLLM reads it, or in ``eagle_config``),
    else vLLM's (2, L/2, L-3)."""
    eagle = getattr(head_config, "eagle_config", None)
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None) or (
        eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None)
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 head: aux hidden-state layers {list(ids)} do not fit a target "
                         f"of {num_target_layers} layers (three ids in 0..{num_target_layers - 1}"
                         "); set eagle_config.eagle_aux_hidden_state_layer_ids in the head's "
                         "config.json")
    return ids


def check_head_fits(head_config: PretrainedConfig, target_config: PretrainedConfig,
                    head_name: str) -> None:
    """``ValueError`` naming both sizes when the head was not trained for this target."""
    target_hidden = target_config.hidden_size
    head_target_hidden = getattr(head_config, "target_hidden_size", None) \
        or head_config.hidden_size
    if head_target_hidden != target_hidden:
        raise ValueError(f"EAGLE-3 head {head_name} reads hidden states of size "
                         f"{head_target_hidden} but the target's hidden size is {target_hidden}: "
                         "use the head trained for this model")
    if head_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"EAGLE-3 head {head_name} has a vocabulary of {head_config.vocab_size} "
                         f"tokens, the target {target_config.vocab_size}: use the head trained "
                         "for this model")


def eagle3_cache_spec(head_config: PretrainedConfig, layer_id: int, tp_size: int,
                      kv_dtype_bytes: int) -> PagedKVSpec:
    """The head's attention KV: one paged layer (``layer_id``, after the target's), in the
    target's block layout and KV budget, with the head's own head count and size."""
    return PagedKVSpec((layer_id,), kv_heads_per_rank(head_config.num_key_value_heads, tp_size),
                       config_head_dim(head_config), kv_dtype_bytes)


class _MidLayer(nn.Module):
    """The head's decoder layer: attention over cat(embedding, hidden) (2H wide)."""

    def __init__(self, ctx: ModelContext, layer_id: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        switches = DenseSwitches(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                 o_bias=bool(getattr(cfg, "attention_bias", False)),
                                 mlp_bias=bool(getattr(cfg, "mlp_bias", False)))
        self.layer_id = layer_id
        self.self_attn = Attention(ctx, switches, "midlayer.self_attn")
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(  # the only change from a Llama layer: 2H in
            2 * hidden, attn.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=switches.qkv_bias, dtype=ctx.dtype, tp=ctx.tp,
            quant_method=ctx.linear_method("midlayer.self_attn.qkv_proj"))
        self.mlp = MLP(ctx, cfg.intermediate_size, switches.mlp_bias, "midlayer.mlp")
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        # Some exports (speculators-trained heads) add the normed hidden state as the residual.
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, caches: ModelCaches, rotary: RotaryEmbedding
                ) -> torch.Tensor:
        """-> p = mlp(norm(r)) + r with r = attn(...) + hidden (the pre-norm output)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(positions, x, batch, caches.kv[self.layer_id], rotary)
        x, residual = self.post_attention_layernorm(
            x, normed if self.norm_before_residual else hidden)
        return self.mlp(x) + residual


class Eagle3Head(nn.Module):
    """The head; ``ctx.hf_config`` is the head's config. ``target_decoder`` lends its embedding
    when the checkpoint has none (a tuple: not registered, so not loaded twice)."""

    def __init__(self, ctx: ModelContext, target_decoder: DecoderModel, layer_id: int,
                 target_hidden_size: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        float_linear = UnquantizedLinearMethod(ctx.backends.float_linear)
        self.fc = ReplicatedLinear(3 * target_hidden_size, hidden, dtype=ctx.dtype,
                                   quant_method=float_linear)
        self.midlayer = _MidLayer(ctx, layer_id)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.lm_head = ReplicatedLinear(hidden, self.draft_vocab_size, dtype=ctx.dtype,
                                        quant_method=float_linear)
        # target id = draft id + d2t[draft id]
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: VocabParallelEmbedding | None = None
        self._target = (target_decoder,)
        head_dim = config_head_dim(cfg)
        self.rotary = RotaryEmbedding(cfg, head_dim, head_dim, ctx.max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """input_ids [T] (the token after each position); hidden [T, 3 Ht] (the target's aux
        states) or [T, H] (the head's previous output) -> the pre-norm output [T, H]."""
        if hidden.shape[-1] == self.fc.input_size:
            hidden = self.fc(hidden)
        embed = self.embed_tokens or self._target[0].embed_tokens
        return self.midlayer(positions, embed(input_ids), hidden, batch, caches, self.rotary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [T, H] -> logits over the draft vocabulary [T, draft_vocab]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.", 1)
            tensors[name] = tensor
        if "embed_tokens.weight" in tensors:  # heads trained with their own embedding
            weight = tensors["embed_tokens.weight"]
            self.embed_tokens = VocabParallelEmbedding(
                weight.shape[0], weight.shape[1], self.fc.weight.dtype).to(self.fc.weight.device)
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)  # the target -> draft mask: not needed to draft
        if d2t is not None:
            if d2t.shape != self.d2t.shape:
                raise ValueError(f"{source}: d2t has {d2t.shape[0]} entries, draft_vocab_size is "
                                 f"{self.draft_vocab_size}; the head's files do not match its "
                                 "config.json")
            self.d2t.copy_(d2t.to(torch.long))
        elif self.draft_vocab_size != (self.embed_tokens or self._target[0].embed_tokens
                                       ).vocab_size:
            raise ValueError(f"{source}: a draft vocabulary of {self.draft_vocab_size} tokens "
                             "needs the d2t tensor (draft -> target ids); the head is incomplete")
        loaded = load_named_weights(self, tensors.items(), stacked=STACKED_PARAMS)
        check_all_loaded(self, loaded, source)
