"""The native build's fallbacks: each returns None with one log line, never raises."""

from __future__ import annotations

import logging
import os

from qwenserve.native import build

SOURCE = os.path.join(os.path.dirname(__file__), "missing_kernel.cpp")


def _load(caplog, name: str):
    build._load.cache_clear()
    with caplog.at_level(logging.INFO, logger="qwenserve"):
        return build.load_library(name, [SOURCE])


def test_switched_off_by_env(monkeypatch, caplog):
    monkeypatch.setenv("QWENSERVE_NATIVE", "0")
    assert _load(caplog, "off_kernels") is None
    assert "QWENSERVE_NATIVE=0" in caplog.text


def test_no_compiler(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-qwenserve")
    assert _load(caplog, "nocc_kernels") is None
    assert "no C++ compiler ('no-such-compiler-qwenserve')" in caplog.text


def test_failed_build_falls_back(monkeypatch, caplog, tmp_path):
    if build.compiler() is None:
        return  # nothing to compile with: the case above covers this machine
    monkeypatch.setenv("QWENSERVE_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    build._load.cache_clear()
    with caplog.at_level(logging.INFO, logger="qwenserve"):
        assert build.load_library("bad_kernels", [str(bad)], cflags=("-O0",)) is None
    assert "failed to build" in caplog.text and "using the PyTorch kernels" in caplog.text


def test_builds_once_then_loads_from_the_cache(monkeypatch, caplog, tmp_path):
    if build.compiler() is None:
        return
    monkeypatch.setenv("QWENSERVE_CACHE_DIR", str(tmp_path))
    src = tmp_path / "add.cpp"
    src.write_text('extern "C" int add(int a, int b) { return a + b; }\n')
    for expect_compile in (True, False):
        build._load.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qwenserve"):
            lib = build.load_library("add_kernels", [str(src)], cflags=("-O1",))
        assert lib is not None and lib.add(2, 3) == 5
        assert ("compiling native add_kernels" in caplog.text) == expect_compile


def test_a_header_on_the_include_path_rebuilds_the_library(monkeypatch, caplog, tmp_path):
    """A library that includes a header from another directory (``-I``) is rebuilt when that
    header changes: a stale library would keep the old header's code."""
    if build.compiler() is None:
        return
    monkeypatch.setenv("QWENSERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / "inc").mkdir()
    header = tmp_path / "inc" / "value.h"
    src = tmp_path / "src" / "value.cpp"
    src.parent.mkdir()
    src.write_text('#include "value.h"\nextern "C" int value() { return VALUE; }\n')
    for value in (1, 2):
        header.write_text(f"#define VALUE {value}\n")
        build._load.cache_clear()
        lib = build.load_library("value_kernels", [str(src)], cflags=("-O0", f"-I{header.parent}"))
        assert lib is not None and lib.value() == value


def test_loading_the_kernels_keeps_subnormal_floats():
    """Loading a kernel library must not switch the process to flush-to-zero (GCC's -ffast-math
    links crtfastmath.o into shared objects before GCC 13, which does that at load time)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from qwenserve.native.attention import decode_attention\n"
        "from qwenserve.native.elementwise import elementwise\n"
        "from qwenserve.native.gemm import gemv\n"
        "from qwenserve.layers.recurrent.fused import native_ops\n"
        "loaded = None not in (decode_attention(), native_ops(), elementwise(), gemv())\n"
        "tiny = torch.tensor([1e-38], dtype=torch.float32) * 1e-3\n"
        "print(loaded, float(tiny[0]) != 0.0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    if out[0] != "True":  # no compiler here: nothing was loaded, nothing to check
        return
    assert out[1] == "True", "a native library turned on flush-to-zero for the whole process"
