"""Qwen3 (dense): the dense decoder with per-head q/k RMSNorm before RoPE and explicit head_dim."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.models.dense import DenseForCausalLM, DenseSwitches

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(DenseForCausalLM):
    @classmethod
    def switches(cls, hf_config: PretrainedConfig) -> DenseSwitches:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DenseSwitches(qkv_bias=bias, o_bias=bias, qk_norm=True)
