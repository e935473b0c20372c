"""ParallelGroup: this rank's place in the tensor-parallel group and its collectives.

With ``world_size == 1`` every collective is the identity, so single-device code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1
    device_group: ProcessGroup | None = None  # the platform's backend (tensors)
    cpu_group: ProcessGroup | None = None  # gloo (Python objects)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def max_flags(self, flags: list[int]) -> list[int]:
        """Element-wise maximum of small integers over ranks, on the CPU group (data-parallel
        replicas agree each step whether any has work, or is stopping)."""
        if self.world_size == 1:
            return list(flags)
        import torch.distributed as dist

        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return [int(v) for v in t.tolist()]

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank over the CPU group."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, group=self.cpu_group, group_src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, over the CPU group."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def shard(self, size: int, what: str) -> int:
        """``size // world_size``, or an error that says what does not divide."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by --tensor-parallel-size "
                             f"{self.world_size}; choose a size that divides it")
        return size // self.world_size


SINGLE = ParallelGroup()
