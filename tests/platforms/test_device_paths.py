"""The CUDA and NPU platforms' logic that needs no hardware, run on CPU tensors: the int8 GEMM's
shape rules and padding, the argument mapping to Ascend's fused op, the local-rank-to-device
mapping, and availability checks. The device calls themselves are replaced by recorders that
enforce the device's documented constraints. Tests that need the real device carry the
``cuda``/``npu`` markers and are skipped without one (tests/conftest.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from qwenserve.distributed.init import Rendezvous
from qwenserve.engine import mp_executor
from qwenserve.platforms.cuda import CudaPlatform
from qwenserve.platforms.npu import NpuPlatform
from qwenserve.quantization.kernels import int8_mm_reference


def int8_operands(m: int, k: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)  # [M, K]
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)  # [N, K]
    scale = torch.rand(n, generator=gen) / 100  # [N]
    token_scale = torch.rand(m, 1, generator=gen) / 100  # [M, 1]
    int_bias = torch.randint(-1000, 1000, (n,), generator=gen, dtype=torch.int32)  # [N]
    return a_q, w_q, scale, token_scale, int_bias


@pytest.fixture
def cublaslt_int_mm(monkeypatch):
    """torch._int_mm with cuBLASLt's int8 rules (more than 16 rows, K and N multiples of 8),
    computed on CPU; records the shapes it was called with."""
    calls = []

    def int_mm(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        assert a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0, calls[-1]
        return a.to(torch.int32) @ b.to(torch.int32)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    return calls


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_int8_mm_pads_small_batches(cublaslt_int_mm, rows, out_dtype):
    args = int8_operands(rows, 64, 48)
    got = CudaPlatform().int8_scaled_mm(*args, out_dtype=out_dtype)
    assert got.shape == (rows, 48) and got.dtype == out_dtype
    torch.testing.assert_close(got, int8_mm_reference(*args, out_dtype=out_dtype))
    assert cublaslt_int_mm[0][0][0] == max(rows, 17)  # padded to 17 rows at most, never cut


@pytest.mark.parametrize(("k", "n"), [(60, 48), (64, 44)])
def test_cuda_int8_mm_declines_unaligned_shapes(cublaslt_int_mm, k, n):
    """K or N not a multiple of 8: None, so the caller dequantizes instead (kernels.Int8Matmul)."""
    assert CudaPlatform().int8_scaled_mm(*int8_operands(4, k, n)) is None
    assert cublaslt_int_mm == []


def test_cuda_local_rank_is_the_device_index(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    for rank in (0, 1, 3):
        assert CudaPlatform().device(rank) == torch.device("cuda", rank)
    assert current == [0, 1, 3]


class FakeTorchNpu(types.ModuleType):
    """``torch_npu`` with ``npu_quant_matmul`` computed as Ascend documents it:
    (x1 @ x2 + bias) * scale * pertoken_scale[:, None] in int32 then float32, cast to
    ``output_dtype``; x2 is [K, N]."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[dict] = []

    def npu_quant_matmul(self, x1, x2, scale, *, pertoken_scale=None, bias=None,
                         output_dtype=torch.float16):
        self.calls.append(dict(x2=tuple(x2.shape), pertoken=pertoken_scale, bias=bias))
        assert x1.dtype == x2.dtype == torch.int8 and x1.shape[1] == x2.shape[0]
        assert pertoken_scale is None or pertoken_scale.dim() == 1
        acc = x1.to(torch.int32) @ x2.to(torch.int32)
        if bias is not None:
            acc = acc + bias
        out = acc.float() * scale
        if pertoken_scale is not None:
            out = out * pertoken_scale[:, None]
        return out.to(output_dtype)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    runtime = types.SimpleNamespace(current=[], set_device=None,
                                    mem_get_info=lambda device: (3 << 30, 64 << 30),
                                    is_available=lambda: True)
    runtime.set_device = runtime.current.append
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr("qwenserve.platforms.npu._torch_npu", lambda: runtime)
    return fake, runtime


@pytest.mark.parametrize("with_scales", [False, True])
def test_npu_int8_mm_maps_arguments_to_npu_quant_matmul(fake_npu, with_scales):
    fake, _ = fake_npu
    a_q, w_q, scale, token_scale, int_bias = int8_operands(5, 64, 48)
    if not with_scales:
        token_scale, int_bias = None, None
    got = NpuPlatform().int8_scaled_mm(a_q, w_q, scale, token_scale, int_bias, torch.bfloat16)
    want = int8_mm_reference(a_q, w_q, scale, token_scale, int_bias, torch.bfloat16)
    torch.testing.assert_close(got, want)
    assert fake.calls[0]["x2"] == (64, 48)  # the weight goes in as [K, N]
    assert (fake.calls[0]["bias"] is None) == (not with_scales)


def test_npu_local_rank_memory_and_availability(fake_npu, monkeypatch):
    _, runtime = fake_npu
    platform = NpuPlatform()
    # torch.device("npu") exists only once torch_npu registered it: record the arguments
    monkeypatch.setattr("qwenserve.platforms.npu.torch", types.SimpleNamespace(
        device=lambda kind, index: (kind, index)))
    assert platform.device(2) == ("npu", 2) and runtime.current == [2]
    assert platform.mem_get_info(("npu", 2)) == (3 << 30, 64 << 30)
    assert platform.default_block_size == 128 and platform.dist_backend == "hccl"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert NpuPlatform.is_available()

    def broken():
        raise RuntimeError("libascendcl.so: cannot open shared object file")

    monkeypatch.setattr("qwenserve.platforms.npu._torch_npu", broken)
    assert not NpuPlatform.is_available()  # a broken CANN install is "not available"


def test_npu_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert not NpuPlatform.is_available()


@pytest.mark.parametrize(("nnodes", "node_rank"), [(1, 0), (2, 0), (2, 1)])
def test_each_node_numbers_its_devices_from_zero(monkeypatch, nnodes, node_rank):
    """TP=4: the ranks a node spawns get local ranks 0.. on that node (rank 0, the driver,
    runs in the engine's own process on node 0's device 0), so each uses its own device."""
    sent = []
    monkeypatch.setattr(mp_executor.subprocess, "Popen", lambda *a, **k: object())
    monkeypatch.setattr(mp_executor, "send_arguments", lambda proc, args: sent.append(args))
    rdzv = Rendezvous("127.0.0.1", 1, 4, nnodes, node_rank)
    mp_executor._Ranks().spawn(None, rdzv)
    ranks = [a.rank for a in sent]
    assert ranks == [r for r in rdzv.local_ranks if r != 0]
    assert [a.local_rank for a in sent] == [r - rdzv.local_ranks.start for r in ranks]
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for a in sent:
        CudaPlatform().device(a.local_rank)
    assert sorted(devices + ([0] if node_rank == 0 else [])) == list(range(rdzv.ranks_per_node))


@pytest.mark.cuda
def test_cuda_int8_mm_on_the_gpu():
    args = [t.cuda() for t in int8_operands(5, 64, 48)]
    got = CudaPlatform().int8_scaled_mm(*args, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got.cpu(), int8_mm_reference(*[t.cpu() for t in args],
                                                            out_dtype=torch.bfloat16))


@pytest.mark.npu
def test_npu_int8_mm_on_the_npu():
    args = int8_operands(5, 64, 48)
    device = NpuPlatform().device(0)
    got = NpuPlatform().int8_scaled_mm(*[t.to(device) for t in args], out_dtype=torch.bfloat16)
    torch.testing.assert_close(got.cpu(), int8_mm_reference(*args, out_dtype=torch.bfloat16))
