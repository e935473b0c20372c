"""Qwen2 / Qwen2.5: the dense decoder with q/k/v biases (always present, no o_proj bias)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.models.dense import DenseForCausalLM, DenseSwitches

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(DenseForCausalLM):
    @classmethod
    def switches(cls, hf_config: PretrainedConfig) -> DenseSwitches:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not "
                             "supported; no released Qwen2/2.5 model enables it")
        return DenseSwitches(qkv_bias=True)
