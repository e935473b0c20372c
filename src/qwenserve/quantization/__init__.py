"""INT8 W8A8 quantization: detection from the checkpoint, the ``--quantization`` flag, and the
linear methods that run it (docs/quantization.md).

``resolve_quantization`` runs when the config is built (no torch import: errors come before any
weight is read); ``build_quant_method`` when a worker builds its model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.logger import init_logger
from qwenserve.quantization import schemes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from qwenserve.config import ModelConfig
    from qwenserve.quantization.kernels import Int8Matmul
    from qwenserve.quantization.quant_config import QuantConfig

logger = init_logger(__name__)


def resolve_quantization(hf_config: PretrainedConfig, requested: str | None) -> tuple[str | None, dict | None]:
    """Return (method, quantization config) for the checkpoint and the user's ``--quantization``.

    Quantized checkpoints are detected (compressed-tensors ``quantization_config``, ModelSlim
    ``quant_model_description.json``) and never loaded as float; a flag that contradicts the
    checkpoint, or a scheme qwenserve cannot run, raises ``ValueError`` naming the fix.
    """
    return schemes.resolve(hf_config, requested)


def build_quant_method(model_config: ModelConfig, matmul: Int8Matmul) -> QuantConfig:
    """The ``ModelContext.quant`` object for ``model_config.quantization``, running ``matmul``
    (the platform's int8 GEMM): ``linear_method(prefix)`` and ``process_weights_after_loading``.
    """
    from qwenserve.quantization.quant_config import (
        CompressedTensorsConfig,
        LoadTimeInt8Config,
        ModelSlimConfig,
    )

    method, config = model_config.quantization, model_config.quant_config or {}
    quant: QuantConfig
    if method == "compressed-tensors":
        quant = CompressedTensorsConfig(config, matmul)
    elif method == "ascend":
        quant = ModelSlimConfig(config["description"], matmul)
    elif method == "int8":
        quant = LoadTimeInt8Config(matmul)
    else:
        raise ValueError(f"unknown quantization method {method!r}; qwenserve runs "
                         f"{', '.join(schemes.METHODS)}")
    logger.info("Quantization %s: INT8 weights, int8 GEMM through the %s platform "
                "(dequantized on the fly where it has none)", quant.name,
                matmul.platform.name if matmul.platform is not None else "no")
    return quant
