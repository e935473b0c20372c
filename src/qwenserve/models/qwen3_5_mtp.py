"""The multi-token-prediction head of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints (``mtp.*``).

One extra decoder layer that predicts the token after next from the target's hidden state and
the next token's embedding (research: vLLM's qwen3_5_mtp.py / qwen3_next_mtp.py, same wiring):

    e = pre_fc_norm_embedding(embed(t[i+1]))          shared embedding table
    h = pre_fc_norm_hidden(hidden[i])                  the target's output (after its final norm)
    x = fc(cat([e, h]))                                fc: [H, 2H], embedding half first
    x, r = layer(x, position i)                        gated full attention (+ MoE MLP in MoE
                                                       checkpoints), its own paged KV (layer
                                                       id num_hidden_layers)
    out = norm(x + r)                                  -> the shared LM head gives t[i+2];
                                                       ``out`` stands in for hidden[i+1] in the
                                                       next draft step

All norms are zero-centred, as in the target. Weights: ``mtp.fc``, ``mtp.pre_fc_norm_*``,
``mtp.layers.0.*``, ``mtp.norm`` (``model.mtp.*`` in some exports); loaded only when
``--speculative-config`` asks for MTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.core.cache.spec import PagedKVSpec
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from qwenserve.layers.moe import SparseMoeBlock
from qwenserve.layers.norm import ZeroCenteredRMSNorm
from qwenserve.models.base import (
    STACKED_PARAMS,
    ModelContext,
    kv_heads_per_rank,
    load_named_weights,
    split_module_weights,
)
from qwenserve.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MTP_PREFIXES = ("mtp.", "model.mtp.")


def mtp_cache_spec(hf_config: PretrainedConfig, tp_size: int, kv_dtype_bytes: int
                   ) -> PagedKVSpec:
    """The head's attention layer: one more paged KV layer (id ``num_hidden_layers``), in the
    target's block layout, counted in the same KV budget."""
    return PagedKVSpec((hf_config.num_hidden_layers,),
                       kv_heads_per_rank(hf_config.num_key_value_heads, tp_size),
                       hf_config.head_dim, kv_dtype_bytes)


class Qwen3_5MTP(nn.Module):
    """The head; the embedding, rotary embedding and LM head are the target's (not owned
    here, so not loaded twice)."""

    def __init__(self, ctx: ModelContext, target: Qwen3_5ForCausalLM) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        self.layer_id = cfg.num_hidden_layers
        self.fc = ReplicatedLinear(2 * hidden, hidden, dtype=ctx.dtype,
                                   quant_method=UnquantizedLinearMethod(
                                       ctx.backends.float_linear))
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        # vLLM builds the layer as "mtp.layers.0": its MLP is MoE where layer 0 would be.
        mlp = target.make_mlp(ctx, 0, "mtp.layers.0.mlp")  # quantization looked up by mtp.*
        self.layers = nn.ModuleList(
            [Qwen3_5DecoderLayer(ctx, self.layer_id, "full_attention", mlp)])
        self.norm = ZeroCenteredRMSNorm(hidden, cfg.rms_norm_eps, ctx.dtype)
        self._target = (target,)  # a tuple: not registered as a submodule

    @property
    def target(self) -> Qwen3_5ForCausalLM:
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """input_ids [T] (the token after each position), hidden [T, H] -> [T, H]."""
        decoder = self.target.model
        e = self.pre_fc_norm_embedding(decoder.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None, batch, caches, decoder.rotary)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        return self.target.compute_logits(hidden, dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.target.greedy_tokens(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """``weights``: the checkpoint's ``mtp.*`` tensors (any others are ignored)."""
        blocks = {"layers.0.mlp.": self.layers[0].mlp} \
            if isinstance(self.layers[0].mlp, SparseMoeBlock) else {}
        loaded: set[str] = set()
        seen = 0

        def relative() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal seen
            for name, tensor in weights:
                prefix = next((p for p in MTP_PREFIXES if name.startswith(p)), None)
                if prefix is None:
                    continue
                seen += 1
                yield name[len(prefix):], tensor

        rest = split_module_weights(relative(), blocks, loaded)
        loaded |= load_named_weights(self, rest, stacked=STACKED_PARAMS)
        missing = [n for n, _ in self.named_parameters() if n not in loaded]
        if not seen:
            raise ValueError(
                f"{source} has no mtp.* tensors: --speculative-config method mtp needs a "
                "checkpoint that ships its multi-token-prediction head (mtp.fc, "
                "mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm); "
                "use method ngram or draft_model with this one")
        if missing:
            shown = ", ".join("mtp." + n for n in missing[:6])
            more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            raise ValueError(f"{source}: the MTP head lacks {shown}{more}; the checkpoint's "
                             "mtp.* tensors are incomplete")
