"""CPU paged attention: C++ decodes that read the cache in place, a C++ kernel for bf16 prefills.

The pure-PyTorch backend gathers every decode's context blocks into a padded copy of K and V,
per layer and step, before one masked SDPA call; this one hands the block tables to
``native/csrc/decode_attention.cpp`` instead, which walks them (bf16 on AMX tiles where the CPU
has them and 2-16 query heads share a KV head, else in 16 or 8 lanes). Prefill chunks in bf16
with head sizes a multiple of 32 run ``native/csrc/prefill_attention.cpp`` (AMX tiles, or
AVX512-BF16 dot products on CPUs without AMX); other prefills (fp32, no AVX512-BF16) and the
cache writes are ``torch_ref``'s (PyTorch's flash kernel).
Where a kernel cannot be built (no compiler, ``QWENSERVE_NATIVE=0``) its part runs
``torch_ref``'s code: same results within bf16 rounding, one log line.
"""

from __future__ import annotations

import torch

from qwenserve.layers.attention.torch_ref import TorchRefBackend, TorchRefMetadata, _decode
from qwenserve.native.attention import decode_attention, prefill_attention

# the reference's metadata serves the kernels as it is (block tables and context lengths)
CpuNativeMetadata = TorchRefMetadata


class CpuNativeBackend(TorchRefBackend):
    name = "cpu_native"

    def __init__(self) -> None:
        self.kernels = decode_attention()
        self.prefill_kernel = prefill_attention()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: CpuNativeMetadata, scale: float) -> torch.Tensor:
        if (0 < meta.num_decodes == q.shape[0] and self.kernels is not None
                and self.kernels.supports(q, kv_cache)):
            # a decode-only step: the kernel writes each token's K and V into its slot, then
            # attends (two index_copy_ calls a layer fewer)
            return self.kernels(q, kv_cache, meta.decode_blocks, meta.decode_ctx_lens,
                                meta.block_size, scale, (k, v, meta.slot_mapping))
        return super().forward(q, k, v, kv_cache, meta, scale)

    def replay_metadata(self, meta: CpuNativeMetadata, width: int,
                        kv_cache: torch.Tensor) -> CpuNativeMetadata | None:
        if (self.kernels is None or not self.kernels.supports_cache(kv_cache) or meta.prefills
                or not meta.num_decodes or meta.decode_blocks.shape[1] > width):
            return None
        blocks = torch.zeros(meta.num_decodes, width, dtype=torch.long)
        blocks[:, : meta.decode_blocks.shape[1]] = meta.decode_blocks
        return CpuNativeMetadata(
            slot_mapping=meta.slot_mapping.clone(), block_size=meta.block_size,
            num_decodes=meta.num_decodes, decode_blocks=blocks,
            decode_ctx_lens=meta.decode_ctx_lens.clone(), prefills=[])

    def refill(self, static: CpuNativeMetadata, meta: CpuNativeMetadata) -> bool:
        width = meta.decode_blocks.shape[1] if meta.decode_blocks is not None else 0
        if (meta.prefills or meta.num_decodes != static.num_decodes
                or width > static.decode_blocks.shape[1]):
            return False
        static.slot_mapping.copy_(meta.slot_mapping)
        static.decode_ctx_lens.copy_(meta.decode_ctx_lens)
        static.decode_blocks[:, :width].copy_(meta.decode_blocks)
        return True

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CpuNativeMetadata,
                scale: float) -> torch.Tensor:
        if self.kernels is None or not self.kernels.supports(q, kv_cache):
            return _decode(q, kv_cache, meta, scale)
        return self.kernels(q, kv_cache, meta.decode_blocks, meta.decode_ctx_lens,
                            meta.block_size, scale)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        if self.prefill_kernel is not None and self.prefill_kernel.supports(q, k, v, scale):
            return self.prefill_kernel(q, k, v, scale)
        return super().prefill(q, k, v, scale)
