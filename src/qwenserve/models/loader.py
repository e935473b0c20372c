"""Checkpoint readers: sharded safetensors (streamed shard by shard) and GGUF.

All shards are checked before any weight is read (index entries exist, headers parse, tensors lie
inside their file), so a broken download fails fast with the file's name, not halfway through.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import torch

from qwenserve.config import ModelSource

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The shard paths of a HF folder, verified to exist and to be complete."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index_path} is not a valid safetensors index ({e}); "
                                 "re-download it") from e
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise ValueError(f"Shard {name} is named in {index_path} but is missing; the "
                                 "download is incomplete: download the model again")
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"No .safetensors weights in {folder}; qwenserve loads safetensors or "
                         "GGUF checkpoints (convert .bin files with transformers' save_pretrained)")
    paths = [os.path.join(folder, name) for name in files]
    for path in paths:
        check_safetensors_file(path)
    return paths


def check_safetensors_file(path: str) -> dict:
    """Parse the header and check every tensor lies inside the file; return the header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise ValueError(f"{path} is not a valid safetensors file (only {size} bytes); "
                             "download it again")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8:
            raise ValueError(f"{path} is not a valid safetensors file or is truncated (header "
                             f"of {header_len} bytes in a {size}-byte file); download it again")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a valid safetensors file (corrupt header: {e}); "
                             "download it again") from e
    data_size = size - 8 - header_len
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
              default=0)
    if end > data_size:
        raise ValueError(f"{path} is truncated: its tensors need {end} bytes of data but the file "
                         f"holds {data_size}; the download was interrupted, download it again")
    return header


def iter_safetensors(paths: list[str], prefixes: tuple[str, ...] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield tensors one at a time; only the current shard is mapped in memory.
    ``prefixes``: only the tensors whose names start with one (the others are never read)."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if prefixes is None or name.startswith(prefixes):
                    yield name, f.get_tensor(name)


def iter_weights(source: ModelSource, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    if source.is_gguf:
        from qwenserve.models.gguf_loader import iter_gguf_weights

        for name, array in iter_gguf_weights(source.gguf_file, hf_config):
            yield name, torch.from_numpy(array)
    else:
        yield from iter_safetensors(safetensors_files(source.folder))
