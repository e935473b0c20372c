"""Native (C++) kernels: compiled at first use, cached, and optional.

``load_extension(name, sources)`` compiles a torch C++ extension once into
``$QWENSERVE_CACHE_DIR/native/<name>-<hash>`` (the hash covers the sources, flags, torch and
Python versions, so an upgrade rebuilds) and loads it from there afterwards. It returns None,
after one log line naming why, when the kernels are switched off (``QWENSERVE_NATIVE=0``), when
no C++ compiler or ninja is on the machine, or when the build fails: callers then run their
pure-PyTorch reference, so a machine without a toolchain serves exactly as before, only slower.
"""

from __future__ import annotations

from qwenserve.native.build import load_extension, native_enabled

__all__ = ["load_extension", "native_enabled"]
