"""Every GEMM weight's first call happens at load (``worker/warm_up.py``): once per linear
layer and LM head of the language model, none for a vision tower, no collective; with enough
rows to pass the platform's kernels that read plain weights and reach its packing one."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config

from helpers.packed_store import settled_packed_bytes
from helpers.recording_linear import RecordingLinear
from qwenserve.layers.backends import Backends, float_linear_route
from qwenserve.layers.linear import LinearBase
from qwenserve.layers.native_gemm import packed_bf16_kernel
from qwenserve.models.base import ModelContext
from qwenserve.models.qwen2 import Qwen2ForCausalLM
from qwenserve.native.gemm import pbgemm
from qwenserve.platforms.cpu import CpuPlatform
from qwenserve.worker.warm_up import warm_up_gemms, warm_up_rows

ROWS = 7


class RecordingGemm:
    """F.linear that remembers which weights it saw (as a packing cache would)."""

    def __init__(self) -> None:
        self.weights: list[int] = []

    def __call__(self, x, weight, bias=None):
        assert x.shape[0] == ROWS
        self.weights.append(id(weight))
        return F.linear(x, weight, bias)


def _model(gemm: RecordingGemm, tie: bool) -> nn.Module:
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    backends = dataclasses.replace(Backends.reference(), float_linear=gemm)
    return Qwen2ForCausalLM(ModelContext(cfg, torch.bfloat16, 64, backends=backends))


def test_each_linear_and_the_lm_head_once():
    for tie in (False, True):
        gemm = RecordingGemm()
        model = _model(gemm, tie)
        linears = [m.weight for m in model.modules() if isinstance(m, LinearBase)]
        count = warm_up_gemms(model, torch.bfloat16, torch.device("cpu"), ROWS)
        assert count == len(linears) + 1 == len(gemm.weights)
        assert sorted(gemm.weights) == sorted([id(w) for w in linears] + [id(model.lm_head.weight)])


def test_a_vision_tower_is_left_alone():
    gemm = RecordingGemm()
    model = _model(gemm, tie=True)
    model.visual = nn.Sequential(_model(gemm, tie=True).model.layers[0].mlp)
    tower = {id(m.weight) for m in model.visual.modules() if isinstance(m, LinearBase)}
    warm_up_gemms(model, torch.bfloat16, torch.device("cpu"), ROWS)
    assert tower and not tower & set(gemm.weights)


def test_the_rows_reach_the_cpu_platform_gemm():
    """On CPU the warm-up rows pass the native kernels that read the plain weight (the skinny
    GEMM's 1-4 float32 rows, the AMX GEMM's 1-96 bf16 rows) and, where oneDNN keeps packed
    float32 copies (AVX512 CPUs), stay below the native float32 GEMM's rows: otherwise the
    packing would fall into the first request's time (it did: 3-4 s of a 44 s prefill run, and
    a 48-row bf16 warm-up once the AMX GEMM took 96 rows). On AVX512-BF16 CPUs without AMX the
    native packed bf16 GEMM makes its own copy from those rows instead. The weight's shape is
    one every kernel takes."""
    platform = CpuPlatform()
    native_bf16 = platform.packed_bf16_gemm() and pbgemm() is not None
    # the packed GEMM's one store of packed weights (the GEMM route's and the fused MLP's)
    store = packed_bf16_kernel()[1].packed if native_bf16 else None
    packed_before = settled_packed_bytes(store) if native_bf16 else 0
    for dtype in (torch.float32, torch.bfloat16):
        packing = RecordingLinear()
        route = float_linear_route(platform, packing)
        weight = torch.randn(64, 64, dtype=dtype)  # kept: a freed weight's packing is dropped
        route(torch.randn(warm_up_rows(platform, dtype), 64, dtype=dtype), weight)
        if dtype == torch.float32 and not platform._has_avx512():
            continue  # AVX2: no packed float32 copy to make; the native GEMM takes these rows
        if dtype == torch.bfloat16 and native_bf16:
            assert packing.calls == 0 and store.packed_bytes == packed_before + 64 * 64 * 2
            continue
        assert packing.calls == 1, dtype


def test_the_rows_follow_the_platforms_windows(monkeypatch):
    """Derived from the platform: a wider AMX window moves the bf16 warm-up with it, W8A8's
    skinny rows count, and a platform whose kernels read no plain weight warms up on one row."""
    monkeypatch.setattr(CpuPlatform, "amx_gemm_max_rows", 200)
    monkeypatch.setattr(CpuPlatform, "int8_skinny_max_rows", lambda self: 9)
    assert warm_up_rows(CpuPlatform(), torch.bfloat16) == 201
    assert warm_up_rows(CpuPlatform(), torch.float32) == 5  # not W8A8: the int8 windows don't
    monkeypatch.setattr(CpuPlatform, "amx_int8_max_rows", 7)
    assert warm_up_rows(CpuPlatform(), torch.float32, int8=True) == 10
    monkeypatch.setattr(CpuPlatform, "amx_int8_max_rows", 30)
    assert warm_up_rows(CpuPlatform(), torch.float32, int8=True) == 31
    bare = SimpleNamespace(bf16_skinny_gemm_max_rows=0, amx_gemm_max_rows=0,
                           skinny_gemm_max_rows=0, int8_skinny_max_rows=lambda: 0,
                           amx_int8_max_rows=0)
    assert warm_up_rows(bare, torch.bfloat16) == warm_up_rows(bare, torch.float32) == 1
    assert warm_up_rows(bare, torch.float32, int8=True) == 1
