"""bf16 GEMMs on weights packed once into oneDNN's blocked layout (CPUs with AMX / AVX512-BF16).

torch's bf16 ``F.linear`` on CPU hands oneDNN the plain [N, K] weight, and oneDNN reorders it
into the blocked layout its AMX kernel reads, on every call: at decode sizes the reorder costs
as much as the product (docs/benchmarks.md, "bf16 on AMX"). vLLM's CPU backend prepacks its
weights for the same reason. Here each weight is packed at its first call and the packed copy
kept beside it, keyed weakly by the weight tensor (it goes when the weight goes) and made again
if the weight is written in place. The plain weight stays the model's: weight accounting, tied
embeddings and sharded-state saving see it unchanged; the price is a second copy of the bf16
weights in host memory (logged once; ``QWENSERVE_PACKED_BF16=0`` turns packing off).
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

logger = logging.getLogger(__name__)

# The batch size oneDNN is told to expect when it chooses the blocked layout; one layout serves
# every batch (1-2,048 rows measured within a few % of a per-size layout).
_PACK_BATCH_HINT = 64


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedBf16Linear:
    """``linear(x, weight, bias)`` for bf16 weights through a once-packed copy of each."""

    def __init__(self) -> None:
        # id(weight) -> (the weight's version when packed, the packed copy); an entry goes
        # when its weight is freed (tensors compare elementwise, so no WeakKeyDictionary)
        self._packed: dict[int, tuple[int, torch.Tensor]] = {}
        self.packed_bytes = 0  # of the weights packed so far

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (weight.dtype == x.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.is_cpu and x.is_cpu and weight.is_contiguous()
                and not weight.requires_grad)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        return _packed_linear(x, self.packed(weight), bias)

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """The blocked copy of ``weight``, made now if it has none or was written since."""
        key = id(weight)
        entry = self._packed.get(key)
        if entry is not None and entry[0] == weight._version:
            return entry[1]
        packed = _pack(weight)
        if entry is None:
            weakref.finalize(weight, self._forget, key, weight.numel() * weight.element_size())
            if not self.packed_bytes:
                logger.info("bf16 GEMMs read each weight packed once for oneDNN's AMX/AVX512-BF16 "
                            "kernels: a second copy of the bf16 weights in host memory "
                            "(QWENSERVE_PACKED_BF16=0 turns this off)")
            self.packed_bytes += weight.numel() * weight.element_size()
        self._packed[key] = (weight._version, packed)
        return packed

    def _forget(self, key: int, nbytes: int) -> None:
        if self._packed.pop(key, None) is not None:
            self.packed_bytes -= nbytes


@functools.lru_cache(maxsize=1)
def packed_bf16_linear() -> PackedBf16Linear | None:
    """The packed bf16 GEMM where this torch build has it and it matches ``F.linear``."""
    try:
        x, w, b = (torch.randn(3, 2, 32).bfloat16(), torch.randn(16, 32).bfloat16(),
                   torch.randn(16).bfloat16())
        got = _packed_linear(x, _pack(w), b)  # the kernel's own two calls, without its log line
        if torch.allclose(got.float(), torch.nn.functional.linear(x, w, b).float(),
                          atol=1e-2, rtol=1e-2):
            return PackedBf16Linear()
    except (RuntimeError, AttributeError):
        pass
    logger.info("this torch build cannot pack bf16 weights for oneDNN; bf16 GEMMs use F.linear")
    return None
