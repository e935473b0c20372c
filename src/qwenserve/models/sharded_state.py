"""``--load-format sharded_state``: vLLM's per-rank pre-sharded checkpoint
(``model-rank-{rank}-part-{part}.safetensors``), read and written.

Each rank's file holds its own parameters already cut for its tensor-parallel slice (or its
experts, with ``--enable-expert-parallel``), under the engine's parameter names, so loading is
one copy per tensor with no slicing: the point of the format for large models. Files written
for one layout load only with the same ``--tensor-parallel-size`` (and expert-parallel choice);
a mismatch is an error that names the layout to use.

Writing needs no process group: the weight loaders only slice, so one process builds each rank's
model in turn with that rank's ``ParallelGroup``, loads the original checkpoint, and saves.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterator

import torch
from torch import nn

PATTERN = "model-rank-{rank}-part-{part}.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def rank_files(folder: str, rank: int) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, PATTERN.format(rank=rank, part="*"))))


@torch.no_grad()
def load_sharded_state(model: nn.Module, folder: str, rank: int, world_size: int) -> None:
    """Copy this rank's tensors into ``model``; every parameter must be found, shapes equal."""
    from safetensors import safe_open

    files = rank_files(folder, rank)
    if not files or rank_files(folder, world_size):  # a file for rank N: written for more ranks
        written = len({os.path.basename(f).split("-")[2] for f in
                       glob.glob(os.path.join(folder, "model-rank-*-part-*.safetensors"))})
        raise ValueError(f"{folder} holds a sharded_state checkpoint for {written or 'no'} "
                         f"ranks; load it with --tensor-parallel-size {written or '?'} (and the "
                         "--enable-expert-parallel choice it was written with)")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name not in params:
                    raise ValueError(f"{path}: tensor {name!r} is not a parameter of this model "
                                     "(written for another architecture or layout?)")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"{path}: {name} has shape {tuple(tensor.shape)}, this rank expects "
                        f"{tuple(params[name].shape)}: written for another tensor-parallel or "
                        "expert-parallel layout")
                params[name].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{folder} (rank {rank}) lacks {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _parts(model: nn.Module, max_size_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """The model's parameters (tied ones once) in files of at most ``max_size_bytes``."""
    part: dict[str, torch.Tensor] = {}
    size, seen = 0, set()
    for name, param in model.named_parameters():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        nbytes = param.numel() * param.element_size()
        if part and size + nbytes > max_size_bytes:
            yield part
            part, size = {}, 0
        part[name] = param.detach().contiguous().cpu()
        size += nbytes
    if part:
        yield part


def save_rank(model: nn.Module, folder: str, rank: int, max_size_bytes: int = 5 << 30) -> None:
    from safetensors.torch import save_file

    for i, tensors in enumerate(_parts(model, max_size_bytes)):
        save_file(tensors, os.path.join(folder, PATTERN.format(rank=rank, part=i)))


def copy_model_files(src: str, dst: str) -> None:
    """config.json, tokenizer and generation files: everything but the weights."""
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and not entry.endswith(_WEIGHT_SUFFIXES) and not entry.endswith(
                ".safetensors.index.json"):
            shutil.copy2(path, os.path.join(dst, entry))
