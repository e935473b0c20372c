"""Llama (and SmolLM2): the dense decoder with optional attention/MLP biases."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.models.dense import DenseForCausalLM, DenseSwitches

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaForCausalLM(DenseForCausalLM):
    @classmethod
    def switches(cls, hf_config: PretrainedConfig) -> DenseSwitches:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DenseSwitches(qkv_bias=bias, o_bias=bias,
                             mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))
