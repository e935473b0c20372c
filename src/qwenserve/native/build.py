"""Compile, cache and load a native kernel library, or explain in one line why not.

Sources are plain C++ with ``extern "C"`` entry points, loaded with ctypes, so a build takes
seconds (no torch headers) and needs only a compiler. The library links the process's OpenMP
runtime by soname (``libgomp.so.1``, the one torch already loaded), so its threads are torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time

from qwenserve import envs
from qwenserve.logger import init_logger
from qwenserve.native.recording import recording_function_type

logger = init_logger(__name__)

# The host's vector ISA: the kernels are built on the machine that runs them.
DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
# Vectorised expf (glibc's libmvec) in the softmax; the kernels test NaN by its bits.
# The parts of -ffast-math that let GCC vectorise the reductions, not -ffast-math itself: before
# GCC 13 that also links crtfastmath.o into shared objects, which turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads (torch's arithmetic included).
# No -ffinite-math-only either: the kernels mask with -inf.
FAST_MATH = ("-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
             "-freciprocal-math")
_FALLBACK = "; using the PyTorch kernels"
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# the ctypes argument types of the entry points: raw pointers, int64 sizes and strides, floats
PTR, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def native_enabled() -> bool:
    """False when ``QWENSERVE_NATIVE=0`` asks for the pure-PyTorch kernels (CI covers both)."""
    return envs.native_kernels_enabled()


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else ``c++``) when it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _headers(sources: tuple[str, ...], cflags: tuple[str, ...]) -> list[str]:
    """The headers next to the sources and in the ``-I`` directories (``#include "x.h"``): part
    of the cache key, so that a changed header rebuilds every library that may include it."""
    dirs = {os.path.dirname(path) for path in sources}
    dirs |= {flag[2:] for flag in cflags if flag.startswith("-I")}
    return [os.path.join(d, name) for d in sorted(dirs) for name in sorted(os.listdir(d))
            if name.endswith(".h")]


def _library_path(name: str, sources: tuple[str, ...], cflags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in (*sources, *_headers(sources, cflags)):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(cflags).encode())
    digest.update(platform.machine().encode())
    return os.path.join(envs.cache_dir(), "native", f"lib{name}-{digest.hexdigest()[:16]}.so")


def _compile(cxx: str, sources: tuple[str, ...], cflags: tuple[str, ...], target: str) -> None:
    """Build into a temporary file and rename it: processes building at once (TP ranks) each
    produce a whole library, and a reader never sees half of one."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        subprocess.run([cxx, *cflags, "-shared", "-fPIC", *sources, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=600)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load(name: str, sources: tuple[str, ...], cflags: tuple[str, ...]) -> ctypes.CDLL | None:
    if not native_enabled():
        logger.info("native %s kernels off (QWENSERVE_NATIVE=0)%s", name, _FALLBACK)
        return None
    cxx = compiler()
    if cxx is None:
        logger.warning("native %s kernels not built: no C++ compiler (%r) on PATH%s",
                       name, os.environ.get("CXX", "c++"), _FALLBACK)
        return None
    target = _library_path(name, sources, cflags)
    if not os.path.isfile(target):
        logger.info("compiling native %s kernels (first use; cached in %s)", name,
                    os.path.dirname(target))
        start = time.perf_counter()
        try:
            _compile(cxx, sources, cflags, target)
        except subprocess.CalledProcessError as e:
            first = (e.stderr or "").strip().splitlines()[:1] or [f"exit {e.returncode}"]
            logger.warning("native %s kernels failed to build (%s)%s", name, first[0][:200],
                           _FALLBACK)
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning("native %s kernels failed to build (%s)%s", name, e, _FALLBACK)
            return None
        logger.info("native %s kernels built in %.1f s", name, time.perf_counter() - start)
    try:
        lib = ctypes.CDLL(target)
    except OSError as e:
        logger.warning("native %s kernels failed to load (%s)%s", name, e, _FALLBACK)
        return None
    lib._FuncPtr = recording_function_type(lib)  # decode steps can be recorded and replayed
    return lib


def load_library(name: str, sources: list[str],
                 cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> ctypes.CDLL | None:
    """The compiled library ``name`` built from ``sources`` (absolute paths), or None (logged
    once) when native kernels are off or cannot be built here."""
    return _load(name, tuple(sources), tuple(cflags))
