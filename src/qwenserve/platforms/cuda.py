"""NVIDIA CUDA platform (NCCL for collectives)."""

from __future__ import annotations

import torch

from qwenserve.platforms.base import Platform


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
