"""The accelerator KV budget (``--gpu-memory-utilization``), exercised on CPU through a platform
that reports device memory like a GPU: utilization x total, minus the weights, the profiled
activations and what other processes hold."""

from __future__ import annotations

import pytest

from qwenserve import LLM
from qwenserve.core.cache.plan import accelerator_kv_budget
from qwenserve.platforms.cpu import CpuPlatform

GIB = 1 << 30
TOTAL = 8 * GIB


class FakeDevice(CpuPlatform):
    """CPU compute; memory answers as an 8 GiB device on which the weights (loaded by now) and
    ``others`` bytes of other processes are in use; ``peak`` bytes of activations."""

    others, peak = GIB, 0
    resets, reads = 0, 0

    @property
    def is_accelerator(self) -> bool:
        return True

    def mem_get_info(self, device):
        return TOTAL - self.others - self.weights, TOTAL

    def reset_peak_memory_stats(self, device) -> None:
        self.resets, self.reads = self.resets + 1, 0

    def max_memory_allocated(self, device) -> int:
        """As a CUDA allocator answers: the weights at the reset, then the weights plus the
        forward pass's activations once the profiling pass ran (the second read)."""
        self.reads += 1
        return self.weights + (self.peak if self.reads > 1 else 0)


def test_budget_arithmetic():
    assert accelerator_kv_budget(64 * GIB, 0.9, 20 * GIB, 3 * GIB, GIB) == int(
        64 * GIB * 0.9) - 24 * GIB
    assert accelerator_kv_budget(32 * GIB, 0.9, 30 * GIB, GIB) < 0


@pytest.mark.parametrize(("others", "peak"), [(0, 0), (GIB, 0), (GIB, 300 << 20)])
def test_engine_budget_subtracts_weights_activations_and_other_processes(
        tiny_model, monkeypatch, others, peak):
    device = FakeDevice()
    device.others, device.peak = others, peak
    monkeypatch.setattr("qwenserve.platforms.resolve_platform", lambda name=None: device)
    monkeypatch.setattr(FakeDevice, "weights", 0, raising=False)
    path = tiny_model("qwen2")
    from qwenserve.worker import worker as worker_module

    load = worker_module.Worker.load_model

    def load_and_record(self):
        load(self)
        FakeDevice.weights = self.weight_bytes()

    monkeypatch.setattr(worker_module.Worker, "load_model", load_and_record)
    llm = LLM(path, dtype="float32", max_model_len=128, gpu_memory_utilization=0.5)
    worker = llm.llm_engine.executor.worker
    expected = TOTAL // 2 - worker.weight_bytes() - others - peak
    assert llm.llm_engine.plan.budget_bytes == expected
    assert device.resets == 1  # one profiling pass, measured from a fresh peak


def test_no_room_names_the_numbers_and_the_flags(tiny_model, monkeypatch):
    device = FakeDevice()
    device.others = 7 * GIB
    monkeypatch.setattr("qwenserve.platforms.resolve_platform", lambda name=None: device)
    monkeypatch.setattr(FakeDevice, "weights", 0, raising=False)
    with pytest.raises(MemoryError, match=r"other processes \(7.0 GiB\).*--gpu-memory-utiliz"):
        LLM(tiny_model("qwen2"), dtype="float32", max_model_len=128, gpu_memory_utilization=0.5)


def test_no_room_for_activations_names_them(tiny_model, monkeypatch):
    device = FakeDevice()
    device.others, device.peak = 0, 4 * GIB
    monkeypatch.setattr("qwenserve.platforms.resolve_platform", lambda name=None: device)
    monkeypatch.setattr(FakeDevice, "weights", 0, raising=False)
    with pytest.raises(MemoryError, match=r"activations \(4.0 GiB\)"):
        LLM(tiny_model("qwen2"), dtype="float32", max_model_len=128, gpu_memory_utilization=0.5)
