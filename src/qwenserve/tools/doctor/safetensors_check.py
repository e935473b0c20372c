"""Read a safetensors header without loading the weights, and check it against the file.

Layout: 8 bytes little-endian header length N, N bytes of JSON (``name -> {dtype, shape,
data_offsets: [begin, end]}``, offsets relative to the data section), then the data section.
An interrupted download leaves a file shorter than the largest ``end``; a Git LFS pointer is a
small text file; both load "fine" until the first read of a missing tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ShardReport:
    """``error`` is None for a sound shard; ``tensor_names`` is empty when the header is
    unreadable."""

    path: Path
    size_bytes: int
    tensor_names: frozenset[str]
    error: str | None = None


def inspect_shard(path: Path) -> ShardReport:
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if prefix.startswith(b"version "):
            return _bad(path, size, "is a Git LFS pointer, not the weights")
        if len(prefix) < 8:
            return _bad(
                path, size, f"is truncated: {size} bytes, shorter than the 8-byte header length"
            )
        header_len = int.from_bytes(prefix, "little")
        if header_len > _MAX_HEADER_BYTES:
            return _bad(path, size, f"has a corrupt header (header length {header_len} bytes)")
        if 8 + header_len > size:
            return _bad(
                path,
                size,
                f"is truncated: the header needs {header_len} bytes, the file has {size}",
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        return _bad(path, size, f"has a corrupt header (not JSON: {e})")
    if not isinstance(header, dict):
        return _bad(path, size, "has a corrupt header (not a JSON object)")
    header.pop("__metadata__", None)
    error = _check_tensors(header, data_bytes=size - 8 - header_len)
    return ShardReport(path, size, frozenset(header), error)


def _bad(path: Path, size: int, error: str) -> ShardReport:
    return ShardReport(path, size, frozenset(), error)


def _check_tensors(header: dict, data_bytes: int) -> str | None:
    """The first tensor whose entry is malformed or lies past the end of the file."""
    for name, entry in header.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape, dtype = entry["shape"], entry["dtype"]
        except (KeyError, TypeError, ValueError):
            return f"has a corrupt header (bad entry for tensor {name})"
        expected = math.prod(shape) * _DTYPE_BYTES.get(dtype, 0)
        if begin < 0 or end < begin or (dtype in _DTYPE_BYTES and end - begin != expected):
            return (
                f"has a corrupt header (tensor {name}: offsets [{begin}, {end}] for {dtype}{shape})"
            )
        if end > data_bytes:
            return (
                f"is truncated: tensor {name} ends at byte {end} of the data section "
                f"but the file holds {data_bytes}"
            )
    return None
