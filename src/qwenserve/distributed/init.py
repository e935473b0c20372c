"""Process-group set-up for tensor parallelism (single node or multi-node from the environment).

Multi-node follows torch.distributed's environment: every node runs the same command with
``MASTER_ADDR``, ``MASTER_PORT``, ``NNODES`` and ``NODE_RANK`` set; node k hosts ranks
``[k * tp / NNODES, (k + 1) * tp / NNODES)`` and node 0 also runs the scheduler and the API.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

from qwenserve import envs
from qwenserve.distributed.parallel_group import ParallelGroup


@dataclass(frozen=True)
class Rendezvous:
    init_method: str
    world_size: int
    nnodes: int = 1
    node_rank: int = 0

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(world_size: int) -> Rendezvous:
    """From ``MASTER_ADDR``/``MASTER_PORT``/``NNODES``/``NODE_RANK``, else a local free port."""
    nnodes = int(envs.get("NNODES", "1") or 1)
    node_rank = int(envs.get("NODE_RANK", "0") or 0)
    if nnodes < 1 or world_size % nnodes:
        raise ValueError(f"--tensor-parallel-size {world_size} must be a multiple of "
                         f"NNODES={nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"NODE_RANK={node_rank} must be in [0, NNODES={nnodes})")
    addr = envs.get("MASTER_ADDR", "127.0.0.1")
    port = envs.get("MASTER_PORT")
    if nnodes > 1 and port is None:
        raise ValueError("multi-node tensor parallelism needs MASTER_ADDR and MASTER_PORT set "
                         "to node 0's address and a free port, on every node")
    return Rendezvous(f"tcp://{addr}:{port or free_port()}", world_size, nnodes, node_rank)


def init_parallel_group(backend: str, rank: int, rdzv: Rendezvous,
                        timeout_s: float = 600.0) -> ParallelGroup:
    """Join the group: ``backend`` for tensors, plus a gloo group for Python objects."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, init_method=rdzv.init_method, rank=rank,
                            world_size=rdzv.world_size, timeout=timeout)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelGroup(rank=rank, world_size=rdzv.world_size, device_group=world,
                         cpu_group=cpu_group)
