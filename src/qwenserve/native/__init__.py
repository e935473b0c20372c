"""Native (C++) kernels: compiled at first use, cached, and optional.

``load_library(name, sources)`` compiles plain C++ (``extern "C"`` functions over raw
pointers, called through ctypes) once into ``$QWENSERVE_CACHE_DIR/native/lib<name>-<hash>.so``
(the hash covers the sources, flags and machine, so an edit rebuilds) and loads it from there
afterwards. It returns None, after one log line naming why, when the kernels are switched off
(``QWENSERVE_NATIVE=0``), when no C++ compiler is on the machine, or when the build fails:
callers then run their pure-PyTorch reference, so a machine without a toolchain serves exactly
as before, only slower.
"""

from __future__ import annotations

from qwenserve.native.build import load_library, native_enabled

__all__ = ["load_library", "native_enabled"]
