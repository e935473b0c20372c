"""CPU platform: memory budget from ``--kv-cache-memory-bytes`` / ``QWENSERVE_CPU_KVCACHE_SPACE``."""

from __future__ import annotations

import ctypes
import functools
import os
import platform as _platform

import psutil
import torch

from qwenserve.platforms.base import EVERY_ROW, Platform, int32_epilogue
from qwenserve.platforms.cpu_packed_gemm import (
    PackedFloatLinear,
    PackedInt8Matmul,
    int8_packing_pays,
    packed_float_linear,
    packed_int8_matmul,
)


@functools.lru_cache(maxsize=1)
def _has_int_mm() -> bool:
    """Whether this torch build computes int8 x int8 -> int32 GEMMs on CPU (oneDNN)."""
    try:
        a = torch.ones(2, 8, dtype=torch.int8)
        return bool(torch._int_mm(a, a.t()).eq(8).all())
    except (RuntimeError, AttributeError):
        return False


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN (the kernel torch.compile's CPU backend calls) for
    float32; other dtypes go to F.linear, since oneDNN's inner product has no bf16/fp16 kernel
    on CPUs without native support and raises instead of falling back."""
    if weight.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.lru_cache(maxsize=1)
def _has_onednn_linear() -> bool:
    """Whether this torch build has oneDNN's linear and it agrees with F.linear here."""
    try:
        x, w, b = torch.randn(3, 2, 16), torch.randn(8, 16), torch.randn(8)
        return bool(torch.allclose(_onednn_linear(x, w, b), torch.nn.functional.linear(x, w, b),
                                   atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


def _packed_or(packed: dict[torch.dtype, PackedFloatLinear], linear, x: torch.Tensor,
               weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    kernel = packed.get(x.dtype)
    if kernel is not None and kernel.supports(x, weight):
        return kernel(x, weight, bias)
    return linear(x, weight, bias)


@functools.cache
def _float_linear(onednn_fp32: bool, packed_dtypes: tuple[torch.dtype, ...]):
    """One function object per route (layers and GEMM wrappers compare them)."""
    linear = _onednn_linear if onednn_fp32 else torch.nn.functional.linear
    packed = {dtype: kernel for dtype in packed_dtypes
              if (kernel := packed_float_linear(dtype)) is not None}
    if not packed:
        return linear if onednn_fp32 else None
    return functools.partial(_packed_or, packed, linear)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _has_avx512() -> bool:
    return "avx512f" in _cpu_flags()


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # The C++ decode kernel (native/csrc/decode_attention.cpp) where a compiler is, else
    # torch_ref's code: 64 decodes over 320-token contexts took 2.2x less CPU time than the
    # gather + SDPA (docs/benchmarks.md).
    default_attention_backend = "cpu_native"
    default_recurrent_backend = "fused"  # native GDN decode/conv where a compiler is present
    # `serve` steps of 1,024 tokens: on CPU a 2,048-token prefill step takes seconds (1.9 s for
    # the Qwen2.5-0.5B shape on 2 Zen 5 cores), every running stream waits for it, and a burst's
    # first tokens land at step ends. At 1,024, 64 requests at once (vllm bench serve, rate inf)
    # got their median first token 9% sooner and the p99 gap between tokens halved, throughput
    # level (docs/benchmarks.md, "Served step size on CPU"). Offline keeps 2,048: its throughput
    # was level too, and no one waits for a first token there.
    default_served_batched_tokens = 1024
    # Decode-sized fp32 GEMMs (1-4 rows) stream the weight once in native/csrc/gemv.cpp: 1.0-1.7x
    # oneDNN's CPU time per shape at 1-4 rows on the AVX2 EPYC (docs/benchmarks.md, "GEMM
    # routes"); from 8 rows the blocked GEMM below wins.
    skinny_gemm_max_rows = 4
    # bf16 GEMMs of one row (decode at one sequence) stream the weight in gemv.cpp with
    # AVX512-BF16 dot products, prefetching a block ahead (1.1-1.35x the AMX kernel per shape
    # before that kernel prefetched; level with it since, Emerald Rapids Xeon, docs/benchmarks.md
    # "Decode GEMMs at the read bandwidth" and "the AMX GEMM prefetches its weight"); from 2
    # rows the AMX kernel (or oneDNN) takes them: decode steps at batch 2 1.13x faster than here.
    bf16_skinny_gemm_max_rows = 1
    # From 8 rows fp32 GEMMs run in native/csrc/sgemm.cpp (AVX2 + FMA, the weight read in
    # place): 0.98-2.16x oneDNN's speed (CPU time) on the model's shapes at 8-2048 rows on the AVX2
    # EPYC, 1.1x or more but for o at 256 and qkv at 2048 rows; 0.91-1.33x at 6 over two runs
    # (docs/benchmarks.md, "Issue 19: native fp32 GEMM"). On AVX512 CPUs its 16-lane build
    # (8 x 32 tiles) takes 16-64 rows, batched decode: 1.06-1.43x oneDNN's packed kernels per
    # shape there, level or behind at 8 and from 96 rows (Sapphire Rapids Xeon,
    # docs/benchmarks.md "float32 decode GEMMs in 16 lanes"); oneDNN keeps 5-15 rows and prefill.
    native_gemm_min_rows = 16 if _has_avx512() else 8
    native_gemm_max_rows = 64 if _has_avx512() else 0
    # bf16 GEMMs of up to 96 rows (decode; one-row calls go to the skinny GEMM above first) on
    # AMX tiles, reading the plain weight: 1.1-2x oneDNN's packed kernels per shape at 1-32 rows
    # (decode steps 1.14-1.32x faster at 1-32 sequences, docs/benchmarks.md "bf16 decode GEMMs on
    # AMX tiles"); since it prefetches the next weight panel, a 24-layer stack's GEMMs run level
    # with oneDNN at 40-48 rows, 1.06-1.1x at 64-96 and level at 112-128 (Emerald Rapids Xeon,
    # "the AMX GEMM prefetches its weight"). CPUs without AMX keep oneDNN (the kernel does not
    # load there).
    amx_gemm_max_rows = 96
    # 1.3-1.8x oneDNN's packed int8 GEMM at 4-96 rows over a 24-layer stack's W8A8 weights
    # (Emerald Rapids, 2 threads; docs/benchmarks.md, "decode steps replayed")
    amx_int8_max_rows = 96
    replays_decode_steps = True
    # A prefill's MLP in chunks of 512 rows: the [rows, 2I] gate_up output and the SiLU pass stay
    # in cache, and oneDNN's down GEMM ran at half speed at 768-1280 rows on the Sapphire
    # Rapids Xeon (2 threads). Qwen2.5-0.5B shape, bf16, 2,048 rows: 31.5 -> 29.0 ms a layer;
    # 1,024 rows: 41.0 -> 29.0 (docs/benchmarks.md, "MLP row chunks").
    mlp_row_chunk = 512
    # fused residual-add + RMSNorm, SiLU-and-mul, rotary where a compiler is (benchmarks.md)
    default_elementwise_backend = "cpu_native"
    # The draw in native/csrc/sampling.cpp: PyTorch's sorts and noises the whole vocabulary,
    # 0.5-4.6 s a step at 64 rows of a 152k vocabulary here (docs/benchmarks.md).
    default_sampling_backend = "cpu_native"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def supports_native_bf16(self) -> bool:
        # AVX512-BF16 or AMX run bf16 GEMMs faster than fp32; elsewhere bf16 is emulated (slow).
        if _platform.machine() in ("arm64", "aarch64"):
            return "bf16" in _cpu_flags()
        return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())

    def describe(self, device: torch.device) -> str:
        return f"cpu ({torch.get_num_threads()} threads)"

    def configure_process(self) -> None:
        """Keep freed memory in the heap: glibc returns large blocks to the OS and every new
        activation tensor then page-faults in afresh, which costs 10-50% of a forward pass on
        CPU (vLLM's CPU guide preloads tcmalloc for the same reason)."""
        if _platform.system() != "Linux":
            return
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 31)

    def float_linear(self):
        # float32 GEMMs: torch's F.linear calls MKL, which on AMD CPUs runs 1.2-2.5x slower than
        # oneDNN for the shapes a model runs (benchmarks.md). bf16 goes to oneDNN either way;
        # with AMX / AVX512-BF16 on weights packed once (cpu_packed_gemm.py): 1.3-2x faster
        # at decode sizes on a Sapphire Rapids Xeon (docs/benchmarks.md, "bf16 on AMX").
        # float32 on AVX512 CPUs (where oneDNN takes every GEMM of 5 rows or more) too: 1.04-1.15x
        # at 64 rows, 1.3-1.5x at 8-16 on an AMX Xeon (docs/benchmarks.md, "float32 on packed
        # weights"); on AVX2 CPUs native/csrc/sgemm.cpp takes them from 8 rows instead. On
        # AVX512-BF16 CPUs without AMX the native packed bf16 GEMM takes the bf16 calls before
        # they reach this route (packed_bf16_gemm), so oneDNN packs only what it leaves.
        packed: list[torch.dtype] = []
        if self.supports_native_bf16() and os.environ.get("QWENSERVE_PACKED_BF16") != "0":
            packed.append(torch.bfloat16)
        if self._has_avx512() and os.environ.get("QWENSERVE_PACKED_FP32") != "0":
            packed.append(torch.float32)
        return _float_linear(_has_onednn_linear(), tuple(packed))

    _has_avx512 = staticmethod(_has_avx512)  # the float32 packing's probe (tests patch it)

    def packed_bf16_gemm(self) -> bool:
        # AVX512-BF16 CPUs without AMX: native/csrc/pbgemm.cpp near the cores' vdpbf16ps peak,
        # 1.1-1.25x oneDNN's packed bf16 kernel at 16-64 rows and level at 512 (Zen 5
        # EPYC, docs/benchmarks.md "A packed bf16 GEMM for AVX512-BF16 CPUs without AMX"); AMX
        # CPUs keep oneDNN's tile kernels. QWENSERVE_PACKED_BF16=0 turns packing off (both kinds).
        flags = _cpu_flags()
        return ("avx512_bf16" in flags and "amx_bf16" not in flags
                and os.environ.get("QWENSERVE_PACKED_BF16") != "0")

    def packed_int8_gemm(self) -> bool:
        # AVX512-VNNI CPUs without AMX-INT8: native/csrc/pigemm.cpp, 1.85x the packed bf16 GEMM
        # and 1.7x torch._int_mm at 64 rows over a 24-layer stack's W8A8 weights (Zen 5 EPYC,
        # docs/benchmarks.md "A packed int8 GEMM for VNNI CPUs without AMX"), where oneDNN's own
        # packed int8 kernel ran its reference path (int8_packing_pays). AMX-INT8 CPUs keep the
        # tile kernel and oneDNN. QWENSERVE_PACKED_INT8=0 turns packing off (both kinds).
        flags = _cpu_flags()
        return ("avx512_vnni" in flags and "amx_int8" not in flags
                and os.environ.get("QWENSERVE_PACKED_INT8") != "0")

    def int8_skinny_max_rows(self) -> int:
        # Without VNNI/AMX, oneDNN's int8 GEMM (torch._int_mm) took 0.9 ms per row of x on the
        # 1152 x 896 qkv weight on the AVX2 EPYC, 6-25x fp32's time at any row count, while the
        # native kernel (AVX2 vpmaddwd, the weight read once for all rows) ran 1.0-6x faster than
        # fp32: there it takes every int8 GEMM. With VNNI/AMX oneDNN (on packed weights) keeps
        # 3 rows and up (it beat fp32 2.2-3.8x on AVX512-VNNI, docs/quantization.md), and the
        # native kernel, 32 values a step there (vpdpwssd), 1-2 rows: W8A8 decode steps 1.27-1.32x
        # faster than oneDNN's at batch 1, 1.08-1.11x at 2, level at 4 on an Emerald Rapids Xeon
        # (docs/benchmarks.md, "bf16 decode GEMMs on AMX tiles").
        return 2 if self._has_int8_dot() else EVERY_ROW

    @staticmethod
    def _has_int8_dot() -> bool:
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & _cpu_flags())

    @functools.cached_property
    def _packed_int8(self) -> PackedInt8Matmul | None:
        """oneDNN's int8 GEMM on weights packed once, where VNNI/AMX runs it (resolved once per
        platform, not per GEMM call, as float_linear's route is): torch._int_mm
        reorders the plain weight on every call; packed, the large shapes (gate_up, LM head) ran
        1.2-2.6x faster at 1-64 rows on a Sapphire Rapids Xeon, the small ones the same
        (docs/benchmarks.md, "INT8 on AMX"). Not where oneDNN runs it on a reference path
        (``int8_packing_pays``: a Zen 5 EPYC with AVX512-VNNI, 0.2 GOP/s)."""
        if not self._has_int8_dot() or os.environ.get("QWENSERVE_PACKED_INT8") == "0":
            return None
        packed = packed_int8_matmul()
        return packed if packed is not None and int8_packing_pays() else None

    def int8_scaled_mm(self, a_q: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                       token_scale: torch.Tensor | None = None,
                       int_bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        # oneDNN's int8 GEMM (VNNI) beat fp32 GEMM at every batch size measured on AVX512-VNNI
        # (docs/quantization.md); see int8_skinny_max_rows for AVX2. w_q.t() is a column-major view,
        # the layout oneDNN reads fastest: no transposed copy of the weight.
        packed = self._packed_int8
        if packed is not None and packed.supports(a_q, w_q):
            return packed(a_q, w_q, scale, token_scale, int_bias, out_dtype)
        if not _has_int_mm():
            return None
        acc = torch._int_mm(a_q, w_q.t())  # [M, N] int32
        return int32_epilogue(acc, scale, token_scale, int_bias, out_dtype)
