"""Huawei Ascend NPU platform through ``torch_npu`` (HCCL for collectives).

``torch_npu`` is imported inside methods only: importing it initialises the CANN runtime, which
must happen once per process and never in processes that do not use the NPU.
"""

from __future__ import annotations

import importlib.util

import torch

from qwenserve.platforms.base import Platform


def _torch_npu():
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    default_block_size = 128  # Ascend's fused attention kernels want 128 (as vLLM Ascend)

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            return bool(_torch_npu().is_available())
        except Exception:  # a broken CANN install: let `qwenserve doctor` explain it
            return False

    def device(self, local_rank: int = 0) -> torch.device:
        _torch_npu().set_device(local_rank)
        return torch.device("npu", local_rank)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return _torch_npu().mem_get_info(device)

    def supports_native_bf16(self) -> bool:
        return True  # 910B computes bf16 natively

    def synchronize(self, device: torch.device) -> None:
        _torch_npu().synchronize(device)

    def empty_cache(self) -> None:
        _torch_npu().empty_cache()

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        _torch_npu().reset_peak_memory_stats(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return _torch_npu().max_memory_allocated(device)

    def int8_scaled_mm(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                       token_scale: torch.Tensor | None = None,
                       int_bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        # One fused aclnn call (what vLLM Ascend uses for W8A8): int8 GEMM + int32 bias +
        # per-channel (and per-token) scale. Not verified on an NPU yet.
        _torch_npu()
        import torch_npu

        pertoken = None if token_scale is None else token_scale.view(-1)
        return torch_npu.npu_quant_matmul(a_q, w_q.t(), scale, pertoken_scale=pertoken,
                                          bias=int_bias, output_dtype=out_dtype)
