"""Compile, cache and load a torch C++ extension, or explain in one line why not."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
from types import ModuleType

from qwenserve import envs
from qwenserve.logger import init_logger

logger = init_logger(__name__)

# -O3 and the host's vector ISA: the kernels are built on the machine that runs them.
DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")


def native_enabled() -> bool:
    """False when ``QWENSERVE_NATIVE=0`` asks for the pure-PyTorch kernels (CI covers both)."""
    return envs.native_kernels_enabled()


def _build_dir(name: str, sources: list[str], cflags: tuple[str, ...]) -> str:
    import torch

    digest = hashlib.sha256()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(cflags).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return os.path.join(envs.cache_dir(), "native", f"{name}-{digest.hexdigest()[:16]}")


def _missing_toolchain() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r}) on PATH"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (pip install ninja)"
    return None


@functools.lru_cache(maxsize=None)
def _load(name: str, sources: tuple[str, ...], cflags: tuple[str, ...]) -> ModuleType | None:
    fallback = "; using the PyTorch kernels"
    if not native_enabled():
        logger.info("native %s kernels off (QWENSERVE_NATIVE=0)%s", name, fallback)
        return None
    missing = _missing_toolchain()
    if missing:
        logger.warning("native %s kernels not built: %s%s", name, missing, fallback)
        return None
    from torch.utils import cpp_extension

    build_dir = _build_dir(name, list(sources), cflags)
    cached = os.path.isdir(build_dir) and any(f.endswith(".so") for f in os.listdir(build_dir))
    os.makedirs(build_dir, exist_ok=True)
    if not cached:
        logger.info("compiling native %s kernels (first use, about a minute) into %s",
                    name, build_dir)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(name=name, sources=list(sources), build_directory=build_dir,
                                    extra_cflags=list(cflags), extra_ldflags=["-fopenmp"],
                                    verbose=False)
    except Exception as e:  # a compiler error must never stop the server: fall back
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        logger.warning("native %s kernels failed to build (%s)%s; the log is in %s",
                       name, first[:200], fallback, build_dir)
        return None
    if not cached:
        logger.info("native %s kernels built in %.0f s", name, time.perf_counter() - start)
    return module


def load_extension(name: str, sources: list[str],
                   cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> ModuleType | None:
    """The compiled extension ``name`` built from ``sources`` (absolute paths), or None (logged
    once) when native kernels are off or cannot be built here."""
    return _load(name, tuple(sources), tuple(cflags))
