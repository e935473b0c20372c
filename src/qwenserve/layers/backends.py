"""Backends: the kernels one platform runs, chosen once by the worker and handed to the model.

The model reads them from its ``ModelContext`` while it builds its layers, so a faster kernel (a
flash-attention or Ascend attention backend, a fused GEMM) plugs in here: a new backend file and
the platform naming it, never a branch in a model or a module rebound after loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from qwenserve.layers.attention import AttentionBackend, get_attention_backend
from qwenserve.layers.native_gemm import (
    GateUpSiluFn,
    GreedyHeadFn,
    amx_gate_up_silu,
    amx_greedy_head,
    packed_gate_up_silu,
    packed_greedy_head,
    with_amx_gemm,
    with_native_gemm,
    with_packed_bf16_gemm,
)
from qwenserve.layers.recurrent import RecurrentBackend, get_recurrent_backend
from qwenserve.layers.skinny_gemm import with_skinny_gemm
from qwenserve.native.elementwise import elementwise as native_elementwise
from qwenserve.native.sampling import sampling as native_sampling
from qwenserve.quantization.kernels import Int8Matmul

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform

# linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N], as F.linear
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class ElementwiseKernels(Protocol):
    """Fused elementwise ops (``native.elementwise.Elementwise`` on CPU). The layers call them for
    tensors ``supports`` accepts and run their PyTorch reference for the rest."""

    def supports(self, x: torch.Tensor) -> bool: ...

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, zero_centred: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor: ...

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None: ...


def get_elementwise_kernels(name: str) -> ElementwiseKernels | None:
    """The fused elementwise kernels called ``name``: None for ``torch_ref`` and where the
    native ones cannot be built (no compiler, ``QWENSERVE_NATIVE=0``: logged once)."""
    if name == "torch_ref":
        return None
    if name == "cpu_native":
        return native_elementwise()
    raise ValueError(f"unknown elementwise backend {name!r}; known: torch_ref, cpu_native")


class SamplingKernel(Protocol):
    """The sampler's draw (``native.sampling.Sampling`` on CPU): greedy or temperature, min_p,
    top_k, top_p and one caller-given uniform per row. The sampler runs its PyTorch draw for
    logits ``supports`` refuses."""

    def supports(self, logits: torch.Tensor) -> bool: ...

    def draw(self, logits: torch.Tensor, temperature: list[float], top_k: list[int],
             top_p: list[float], min_p: list[float], uniform: torch.Tensor) -> torch.Tensor: ...

    def logprobs(self, logits: torch.Tensor, row_index: list[int], token_ids: list[int],
                 num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of the raw logits' rows ``row_index``: the log-probability and rank of each row's
        token, and its ``num_top`` largest log-probabilities with their ids ([n], [n], [n, k],
        [n, k]), without a [rows, vocab] log_softmax."""
        ...


def get_sampling_kernel(name: str) -> SamplingKernel | None:
    """The draw called ``name``: None for ``torch_ref`` and where the native one cannot be
    built (no compiler, ``QWENSERVE_NATIVE=0``: logged once)."""
    if name == "torch_ref":
        return None
    if name == "cpu_native":
        return native_sampling()
    raise ValueError(f"unknown sampling backend {name!r}; known: torch_ref, cpu_native")


def float_linear_route(platform: Platform, linear: LinearFn) -> LinearFn:
    """``linear`` (the platform's GEMM) behind the native kernels that take some of its calls by
    dtype and rows of x: the skinny GEMM (fewest rows), the AMX bf16 GEMM, the blocked float32
    GEMM, the packed bf16 GEMM of CPUs without AMX."""
    native = with_native_gemm(with_packed_bf16_gemm(linear, platform.packed_bf16_gemm()),
                              platform.native_gemm_min_rows, platform.native_gemm_max_rows)
    return with_skinny_gemm(with_amx_gemm(native, platform.amx_gemm_max_rows),
                            platform.skinny_gemm_max_rows, platform.bf16_skinny_gemm_max_rows)


@dataclass(frozen=True)
class Backends:
    attention: AttentionBackend  # paged attention layers
    recurrent: RecurrentBackend  # Gated DeltaNet layers
    float_linear: LinearFn  # float (unquantized) linear layers and the LM head
    int8_mm: Int8Matmul  # INT8 W8A8 linear layers (quantized checkpoints, --quantization int8)
    # RMSNorm (+ residual add), SiLU-and-mul and rotary of the decoder layers; None: PyTorch's
    elementwise: ElementwiseKernels | None = None
    sampling: SamplingKernel | None = None  # the sampler's draw; None: PyTorch's
    mlp_row_chunk: int = 0  # rows an MLP takes at a time (Platform.mlp_row_chunk); 0: all
    # an unquantized MLP's gate_up GEMM and SiLU-and-mul in one kernel, for the calls it takes
    # (returns None for the rest); None: the GEMM, then ``elementwise``'s SiLU-and-mul
    gate_up_silu: GateUpSiluFn | None = None
    # a greedy step's LM head and argmax in one kernel, for the calls it takes (returns None for
    # the rest); None: the logits, then the sampler
    greedy_head: GreedyHeadFn | None = None

    @classmethod
    def for_platform(cls, platform: Platform) -> Backends:
        elementwise = get_elementwise_kernels(platform.default_elementwise_backend)
        return cls(
            attention=get_attention_backend(platform.default_attention_backend),
            recurrent=get_recurrent_backend(platform.default_recurrent_backend),
            float_linear=float_linear_route(platform, platform.float_linear() or F.linear),
            int8_mm=Int8Matmul(platform, quantizer=elementwise),
            elementwise=elementwise,
            sampling=get_sampling_kernel(platform.default_sampling_backend),
            mlp_row_chunk=platform.mlp_row_chunk,
            # the AMX GEMM's rows (one-row calls keep the skinny GEMM, as float_linear routes
            # them)
            gate_up_silu=amx_gate_up_silu(platform.bf16_skinny_gemm_max_rows + 1,
                                          platform.amx_gemm_max_rows)
            or packed_gate_up_silu(platform.bf16_skinny_gemm_max_rows + 1,
                                   platform.packed_bf16_gemm()),
            greedy_head=amx_greedy_head(platform.bf16_skinny_gemm_max_rows + 1,
                                        platform.amx_gemm_max_rows)
            or packed_greedy_head(platform.bf16_skinny_gemm_max_rows + 1,
                                  platform.packed_bf16_gemm()),
        )

    @classmethod
    def reference(cls) -> Backends:
        """The pure-PyTorch kernels (a model built without a platform: tests, the planner)."""
        return cls(
            attention=get_attention_backend("torch_ref"),
            recurrent=get_recurrent_backend("torch_ref"),
            float_linear=F.linear,
            int8_mm=Int8Matmul(None),
        )
