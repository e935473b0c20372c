"""Shared fixtures: tiny random-weight models written once per session, device-test markers."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `helpers` package

from helpers.tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model("qwen2")`` -> path of a random-weight model folder (built once)."""
    root = tmp_path_factory.mktemp("tiny_models")

    def build(arch: str, seed: int = 0, **overrides) -> str:
        suffix = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
        path = os.path.join(str(root), f"{arch}-{seed}-{suffix}")
        return make_tiny_model(arch, path, seed=seed, **overrides)

    return build


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One torch thread in the pytest process (yields the default it replaced). The models run
    here are tiny: a second thread only adds fork/join and spin time, and on a busy 2-core CI
    host each multi-threaded op waits for its worker to be scheduled (measured on the loaded
    2-core VM, tests/models/test_parity.py -k "qwen3_5_moe or qwen2-": 23 s of CPU and 52 s wall
    with one thread, 208 s and 426 s with two). Spawned servers and ranks keep their own
    settings (this sets no ``OMP_NUM_THREADS``); a module running a real model takes the
    default back (tests/entrypoints/test_llm_default_model.py)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield before
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Skip device tests when the device is absent, and benchmark-sized runs (soak, sweeps)
    unless ``QWENSERVE_RUN_BENCHMARKS=1``: CI runs their smaller versions."""
    if os.environ.get("QWENSERVE_RUN_BENCHMARKS") != "1":
        skip_bench = pytest.mark.skip(reason="benchmark-sized; set QWENSERVE_RUN_BENCHMARKS=1")
        for item in items:
            if item.get_closest_marker("benchmark") is not None:
                item.add_marker(skip_bench)

    def available(name: str) -> bool:
        try:
            from qwenserve.platforms.cuda import CudaPlatform
            from qwenserve.platforms.npu import NpuPlatform

            return {"cuda": CudaPlatform, "npu": NpuPlatform}[name].is_available()
        except Exception:
            return False

    for marker in ("cuda", "npu"):
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and not available(marker):
            skip = pytest.mark.skip(reason=f"needs a {marker.upper()} device")
            for item in marked:
                item.add_marker(skip)
