"""Platform seam: everything that differs between CPU, CUDA and Ascend NPU.

This package is the only code that names ``torch.cuda``, ``torch.npu``, ``torch_npu``, ``nccl`` or
``hccl``; the rest of qwenserve asks the platform object it was handed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

# A row window with no upper end: the native kernel takes the GEMM at any number of rows.
EVERY_ROW = 1 << 62

class Platform(ABC):
    name: ClassVar[str]
    device_type: ClassVar[str]  # torch device string
    dist_backend: ClassVar[str]  # torch.distributed backend for tensor collectives
    visible_devices_env: ClassVar[str] = ""
    default_attention_backend: ClassVar[str] = "torch_ref"  # layers/attention/__init__.py
    default_recurrent_backend: ClassVar[str] = "torch_ref"  # layers/recurrent/__init__.py
    # RMSNorm / SiLU-and-mul / rotary: "torch_ref" (the layers' PyTorch code) or "cpu_native"
    # (native/csrc/elementwise.cpp); layers/backends.py
    default_elementwise_backend: ClassVar[str] = "torch_ref"
    default_sampling_backend: ClassVar[str] = "torch_ref"  # the sampler's draw
    default_block_size: ClassVar[int] = 16
    # --max-num-batched-tokens when not given, offline (LLM) and under `serve`, as vLLM's
    # per-platform defaults for its LLM class and its API server
    default_batched_tokens: ClassVar[int] = 2048
    default_served_batched_tokens: ClassVar[int] = 2048
    # float32 / bf16 GEMMs with at most this many rows of x (decode) go to the native skinny GEMM
    # (native/csrc/gemv.cpp, which streams the weight once) where it builds (bf16: with
    # AVX512-BF16); 0: never.
    skinny_gemm_max_rows: ClassVar[int] = 0
    bf16_skinny_gemm_max_rows: ClassVar[int] = 0
    # float32 GEMMs with at least native_gemm_min_rows rows of x (prefill, batched decode) and at
    # most native_gemm_max_rows (0: no limit) go to the native blocked GEMM
    # (native/csrc/sgemm.cpp) where it builds; min 0: never.
    native_gemm_min_rows: ClassVar[int] = 0
    native_gemm_max_rows: ClassVar[int] = 0
    # bf16 GEMMs of 1 to amx_gemm_max_rows rows of x go to the native AMX GEMM
    # (native/csrc/bgemm.cpp) where the CPU has AMX; 0: never.
    amx_gemm_max_rows: ClassVar[int] = 0
    # W8A8 GEMMs of more than int8_skinny_max_rows() and at most this many rows of x go to the
    # native AMX-INT8 GEMM (native/csrc/igemm.cpp) where the CPU has AMX; 0: never.
    amx_int8_max_rows: ClassVar[int] = 0
    # decode steps whose every op is a native kernel call are recorded once per batch size and
    # replayed (worker/decode_replay.py): the host-side counterpart of a CUDA graph
    replays_decode_steps: ClassVar[bool] = False
    # MLPs run on at most this many rows at a time (longer prefills in row chunks, each through
    # gate_up, SiLU-and-mul and down); 0: all rows at once.
    mlp_row_chunk: ClassVar[int] = 0
    supported_block_sizes: ClassVar[tuple[int, ...]] = (1, 8, 16, 32, 64, 128, 256)

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Cheap check that must not initialise the device runtime needlessly."""

    @abstractmethod
    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device of ``local_rank`` (and make it current)."""

    @abstractmethod
    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free_bytes, total_bytes) of the device."""

    @abstractmethod
    def supports_native_bf16(self) -> bool:
        """Whether bfloat16 matmuls run at least as fast as float32 here."""

    def configure_process(self) -> None:
        """Process-wide tuning done once before loading (allocator settings and the like)."""

    def synchronize(self, device: torch.device) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device (no-op on CPU)."""

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a fresh peak-memory measurement."""

    def max_memory_allocated(self, device: torch.device) -> int:
        """Peak bytes allocated by torch since the last reset."""
        return 0

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"

    def describe(self, device: torch.device) -> str:
        return str(device)

    def float_linear(self) -> Callable[..., torch.Tensor] | None:
        """A faster ``linear(x, weight, bias)`` for float weights than ``F.linear``, or None.
        Contract: same results as ``F.linear`` up to fp32 summation order."""
        return None

    def packed_bf16_gemm(self) -> bool:
        """Whether bf16 GEMMs (of more rows than the skinny GEMM takes) go to the native packed
        GEMM (native/csrc/pbgemm.cpp, on its own once-packed copy of each weight) where it
        builds."""
        return False

    def packed_int8_gemm(self) -> bool:
        """Whether W8A8 GEMMs of any rows go to the native packed int8 GEMM
        (native/csrc/pigemm.cpp, on its own once-packed copy of each weight) where it builds;
        the skinny int8 GEMM then keeps only the weights it does not pack (views)."""
        return False

    def int8_scaled_mm(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                       token_scale: torch.Tensor | None = None,
                       int_bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """``(a_q @ w_q.T + int_bias) * scale * token_scale`` through an int8 GEMM.

        a_q [M, K] int8, w_q [N, K] int8, scale [N] float32, token_scale [M, 1] float32,
        int_bias [N] int32. Returns [M, N] in ``out_dtype``, or None where this platform has no
        int8 GEMM for these shapes: the caller then dequantizes the weight on the fly.
        """
        return None

    def int8_skinny_max_rows(self) -> int:
        """Up to how many rows of x an int8 GEMM runs the native kernel
        (native/csrc/gemv.cpp, CPU tensors) instead of ``int8_scaled_mm``; 0: never,
        ``EVERY_ROW``: always."""
        return 0


def int32_epilogue(acc: torch.Tensor, scale: torch.Tensor, token_scale: torch.Tensor | None,
                   int_bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Scale an exact int32 GEMM result [M, N] back to real values (shared by CPU and CUDA)."""
    if int_bias is not None:
        acc = acc + int_bias
    out = acc.to(torch.float32) * scale
    if token_scale is not None:
        out = out * token_scale
    return out.to(out_dtype)
