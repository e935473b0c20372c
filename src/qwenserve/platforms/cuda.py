"""NVIDIA CUDA platform (NCCL for collectives)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwenserve.platforms.base import Platform, int32_epilogue


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device(self, local_rank: int = 0) -> torch.device:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def supports_native_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def describe(self, device: torch.device) -> str:
        return f"{device} ({torch.cuda.get_device_name(device)})"

    def int8_scaled_mm(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                       token_scale: torch.Tensor | None = None,
                       int_bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        # cuBLASLt int8 (torch._int_mm) needs K and N multiples of 8 and more than 16 rows:
        # decode batches are padded with zero rows. Not verified on a GPU yet.
        num_rows, k = a_q.shape
        if k % 8 or w_q.shape[0] % 8:
            return None
        if num_rows <= 16:
            a_q = F.pad(a_q, (0, 0, 0, 17 - num_rows))
        acc = torch._int_mm(a_q, w_q.t())[:num_rows]  # [M, N] int32
        return int32_epilogue(acc, scale, token_scale, int_bias, out_dtype)
