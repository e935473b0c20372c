"""What ``ModelContext.quant`` holds: a linear method per layer, and one pass after loading.

Models ask ``linear_method(prefix)`` with their module path (``model.layers.0.self_attn.qkv_proj``,
merged names); the checkpoint's names (``q_proj``, ``k_proj``, ``v_proj``) are derived from it
with ``schemes.shard_names``. None means the layer stays float.
"""

from __future__ import annotations

from torch import nn

from qwenserve.layers.linear import LinearMethod
from qwenserve.layers.moe import ExpertMethod
from qwenserve.quantization import schemes
from qwenserve.quantization.expert_methods import Int8Experts
from qwenserve.quantization.kernels import Int8Matmul
from qwenserve.quantization.methods import AscendW8A8StaticMethod, Int8LinearMethod


class QuantConfig:
    name = ""

    def __init__(self, matmul: Int8Matmul) -> None:
        self.matmul = matmul  # the platform's int8 GEMM (``Backends.int8_mm``)

    def linear_method(self, prefix: str) -> LinearMethod | None:
        raise NotImplementedError

    def expert_method(self, prefix: str, num_experts: int) -> ExpertMethod | None:
        """INT8 or float (None) for the MoE experts at ``prefix`` (``...mlp.experts`` with
        ``num_experts`` experts, or a one-expert ``...mlp.shared_expert``)."""
        return None

    def process_weights_after_loading(self, model: nn.Module) -> None:
        """Per-layer finishing after every tensor is in (folded biases, per-shard scales)."""
        for module in model.modules():
            process = getattr(getattr(module, "quant_method", None), "process_weights", None)
            if process is not None:
                process(module)


class CompressedTensorsConfig(QuantConfig):
    """llm-compressor's INT8 W8A8: per-channel int8 weights, dynamic per-token activations."""

    name = "compressed-tensors"

    def __init__(self, config: dict, matmul: Int8Matmul) -> None:
        super().__init__(matmul)
        self.config = config

    def linear_method(self, prefix: str) -> LinearMethod | None:
        shards = schemes.shard_names(prefix)
        quantized = [schemes.ct_scheme_for(name, self.config) is not None for name in shards]
        if not any(quantized):
            return None
        if not all(quantized):
            raise ValueError(f"compressed-tensors quantizes only some of {', '.join(shards)}; "
                             "qwenserve runs them as one matrix, so all or none must be")
        return Int8LinearMethod(self.matmul, zero_point="weight_zero_point")

    def expert_method(self, prefix: str, num_experts: int) -> ExpertMethod | None:
        names = schemes.expert_weight_names(prefix, num_experts)
        quantized = {schemes.ct_scheme_for(name.removesuffix(".weight"), self.config) is not None
                     for name in names}
        if len(quantized) > 1:
            raise ValueError(f"compressed-tensors quantizes only some of the projections of "
                             f"{prefix}; qwenserve runs a layer's experts as one stack, so all or "
                             "none must be")
        return Int8Experts(self.matmul) if quantized.pop() else None


class ModelSlimConfig(QuantConfig):
    """Ascend ModelSlim W8A8 (static activations) and W8A8_DYNAMIC, per layer as described."""

    name = "ascend"

    def __init__(self, description: dict, matmul: Int8Matmul) -> None:
        super().__init__(matmul)
        self.description = description

    def linear_method(self, prefix: str) -> LinearMethod | None:
        quant_type = schemes.modelslim_type_for(prefix, self.description)
        if quant_type == "W8A8":
            return AscendW8A8StaticMethod(self.matmul)
        if quant_type == "W8A8_DYNAMIC":
            return Int8LinearMethod(self.matmul, zero_point="weight_offset")
        return None

    def expert_method(self, prefix: str, num_experts: int) -> ExpertMethod | None:
        quant_type = schemes.modelslim_expert_type(prefix, num_experts, self.description)
        return Int8Experts(self.matmul) if quant_type == "W8A8_DYNAMIC" else None


class LoadTimeInt8Config(QuantConfig):
    """``--quantization int8``: every linear layer of a float checkpoint, per-channel
    symmetric, quantized tensor by tensor while loading; then the embedding and LM head tables,
    per row (a tied head shares the embedding's int8 table)."""

    name = "int8"

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return Int8LinearMethod(self.matmul, quantize_on_load=True)

    def process_weights_after_loading(self, model: nn.Module) -> None:
        from qwenserve import envs
        from qwenserve.layers.embedding import quantize_vocab_tables

        super().process_weights_after_loading(model)
        if not envs.int8_float_vocab():
            quantize_vocab_tables(model, self.matmul)
