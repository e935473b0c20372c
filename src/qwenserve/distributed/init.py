"""Process-group set-up and tear-down for tensor parallelism (one node, or several from the
environment).

The ranks meet at a TCPStore that rank 0 serves, then exchange pickled objects over gloo, so the
store's port is a way into every rank. On one node rank 0 binds it to 127.0.0.1 and holds the port
from the moment it is chosen until the store serves it (no pick-then-bind race), and gloo's
sockets stay on the loopback interface. Several nodes follow torch.distributed's environment:
every node runs the same command with ``MASTER_ADDR``, ``MASTER_PORT``, ``NNODES`` and
``NODE_RANK`` set; node k hosts ranks ``[k * tp / NNODES, (k + 1) * tp / NNODES)``, node 0 also
runs the scheduler and the API, and serves the store on ``MASTER_ADDR`` (docs/parallelism.md
says what that exposes).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qwenserve import envs
from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed import ProcessGroup as ProcessGroupHandle

logger = init_logger(__name__)

LOOPBACK = "127.0.0.1"
_JOINED = "qwenserve/joined/{rank}"  # store key each rank sets once it reached the store


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: plain data, sent to every worker process."""

    host: str
    port: int
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


def rendezvous(world_size: int) -> tuple[Rendezvous, socket.socket | None]:
    """Where to meet, from ``MASTER_ADDR``/``MASTER_PORT``/``NNODES``/``NODE_RANK``, else on a
    loopback port; on node 0 also the socket rank 0's store will serve, already listening."""
    nnodes = int(envs.get("NNODES", "1") or 1)
    node_rank = int(envs.get("NODE_RANK", "0") or 0)
    if nnodes < 1 or world_size % nnodes:
        raise ValueError(f"--tensor-parallel-size {world_size} must be a multiple of "
                         f"NNODES={nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"NODE_RANK={node_rank} must be in [0, NNODES={nnodes})")
    port = envs.get("MASTER_PORT")
    if nnodes > 1 and port is None:
        raise ValueError("multi-node tensor parallelism needs MASTER_ADDR and MASTER_PORT set "
                         "to node 0's address and a free port, on every node")
    if nnodes == 1:  # MASTER_ADDR/MASTER_PORT are for several nodes; one node stays private
        listener = _listen(LOOPBACK, 0)
        return Rendezvous(LOOPBACK, listener.getsockname()[1], world_size), listener
    host = envs.get("MASTER_ADDR", LOOPBACK) or LOOPBACK
    rdzv = Rendezvous(host, int(port or 0), world_size, nnodes, node_rank)
    return rdzv, _listen_for_nodes(host, rdzv.port) if node_rank == 0 else None


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)  # ranks that arrive before the store serves wait in the backlog
    except BaseException:
        sock.close()
        raise
    return sock


def _listen_for_nodes(host: str, port: int) -> socket.socket:
    """Node 0's store socket: on ``MASTER_ADDR`` only, or on every interface when that address
    is not one of this host's own (behind NAT, a load balancer or a container port mapping)."""
    try:
        return _listen(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise OSError(e.errno, f"MASTER_PORT={port} is already in use on node 0; choose a "
                          "free port and set it on every node") from e
        if e.errno != errno.EADDRNOTAVAIL:
            raise
    logger.warning("MASTER_ADDR=%s is not an address of this host, so the tensor-parallel "
                   "rendezvous listens on every interface (port %d); keep that port on a "
                   "private network (see docs/parallelism.md)", host, port)
    ipv6 = socket.getaddrinfo(host, port)[0][0] == socket.AF_INET6
    return _listen("::" if ipv6 else "0.0.0.0", port)


def init_parallel_group(backend: str, rank: int, rdzv: Rendezvous,
                        listener: socket.socket | None = None,
                        check_peers: Callable[[], None] | None = None,
                        timeout_s: float = 600.0) -> ParallelGroup:
    """Join the group: ``backend`` for tensors, plus a gloo group for Python objects.

    Rank 0 serves the store on ``listener`` and waits until every rank has reached it, calling
    ``check_peers`` (which raises when a local worker died) while it waits. Either the group is
    returned, or no process group is left behind.
    """

    timeout = datetime.timedelta(seconds=timeout_s)
    store = _join_store(rank, rdzv, listener, timeout)
    if rank == 0:
        _wait_for_ranks(store, rdzv, check_peers, timeout_s)
    return _group_from_store(backend, store, rank, rdzv.world_size, timeout,
                             loopback=rdzv.nnodes == 1)


def serve_store(world_size: int, timeout_s: float = 600.0, host: str = LOOPBACK,
                port: int = 0) -> tuple[dist.TCPStore, int]:
    """A rendezvous store, served by a process that is not itself a rank (the API process, for
    the expert-parallel group over data-parallel replicas): (store, port). On a loopback port
    by default; on ``host:port`` for other nodes (on every interface when ``host`` is not one
    of this host's addresses)."""
    import torch.distributed as dist

    listener = _listen(LOOPBACK, 0) if host == LOOPBACK and not port else \
        _listen_for_nodes(host, port)
    port = listener.getsockname()[1]
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    return store, port


def join_group_at(backend: str, rank: int, world_size: int, host: str, port: int,
                  timeout_s: float = 600.0) -> ParallelGroup:
    """Join a group whose store another process serves (``serve_store``)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout,
                          wait_for_workers=False)
    return _group_from_store(backend, store, rank, world_size, timeout,
                             loopback=host == LOOPBACK)


@dataclass(frozen=True)
class DataParallelGroups:
    """A rank's groups when expert parallelism spans data-parallel replicas (DP x EP)::

        global rank = replica * tp + tp rank        tp 2, 2 replicas:  moe     [0 1 2 3]
                                                                       tp      [0 1] [2 3]
                                                                       drivers [0 2]
    """

    tp: ParallelGroup  # this replica's tensor-parallel ranks
    moe: ParallelGroup  # every rank of every replica: the experts are spread over them
    drivers: ParallelGroup  # each replica's rank 0 (the engine cores' lock-step); rank = replica


def join_data_parallel_groups(backend: str, replica: int, replicas: int, tp_size: int,
                              tp_rank: int, host: str, port: int) -> DataParallelGroups:
    """Join the group over every rank of every replica, then make the subgroups (every rank
    makes each of them, in the same order, as torch.distributed requires)."""
    import torch.distributed as dist

    moe = join_group_at(backend, replica * tp_size + tp_rank, replicas * tp_size, host, port)
    if tp_size == 1:
        return DataParallelGroups(ParallelGroup(), moe, moe)
    try:
        mine: tuple[ProcessGroupHandle, ProcessGroupHandle] | None = None
        for r in range(replicas):
            ranks = list(range(r * tp_size, (r + 1) * tp_size))
            device = dist.new_group(ranks, backend=backend)
            cpu = device if backend == "gloo" else dist.new_group(ranks, backend="gloo")
            if r == replica:
                mine = (device, cpu)
        drivers = dist.new_group([r * tp_size for r in range(replicas)], backend="gloo")
    except BaseException:
        dist.destroy_process_group()
        raise
    assert mine is not None
    return DataParallelGroups(
        ParallelGroup(rank=tp_rank, world_size=tp_size, device_group=mine[0], cpu_group=mine[1]),
        moe, ParallelGroup(rank=replica, world_size=replicas, device_group=drivers,
                           cpu_group=drivers))


def _join_store(rank: int, rdzv: Rendezvous, listener: socket.socket | None,
                timeout: datetime.timedelta) -> dist.TCPStore:
    import torch.distributed as dist

    if rank == 0:
        if listener is None:
            raise ValueError("rank 0 serves the rendezvous and needs its listening socket")
        # The store takes the socket over (and closes it when it goes).
        store = dist.TCPStore(rdzv.host, rdzv.port, rdzv.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(rdzv.host, rdzv.port, rdzv.world_size, is_master=False,
                              timeout=timeout, wait_for_workers=False)
    store.set(_JOINED.format(rank=rank), "1")
    return store


def _wait_for_ranks(store: dist.TCPStore, rdzv: Rendezvous,
                    check_peers: Callable[[], None] | None, timeout_s: float) -> None:
    """Wait in short slices, so a worker that died before it joined is reported at once
    instead of after the whole timeout."""
    deadline = time.monotonic() + timeout_s
    waiting = list(range(1, rdzv.world_size))
    while waiting:
        waiting = [r for r in waiting if not store.check([_JOINED.format(rank=r)])]
        if not waiting:
            return
        if check_peers is not None:
            check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Tensor-parallel ranks {waiting} did not join the rendezvous at {rdzv.host}:"
                f"{rdzv.port} within {timeout_s:.0f} s. With several nodes, check that every "
                "node runs the same command with NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT "
                "set, and can reach MASTER_ADDR:MASTER_PORT")
        time.sleep(0.05)


@contextlib.contextmanager
def _gloo_on_loopback(one_node: bool) -> Iterator[None]:
    """Gloo binds its sockets to the address the host name resolves to, often a public one;
    on one node use the loopback interface instead, unless ``GLOO_SOCKET_IFNAME`` is set.
    (Gloo reads only that variable, so it is set around the group's creation.)"""
    name = "GLOO_SOCKET_IFNAME"
    interface = _loopback_interface() if one_node and envs.get(name) is None else None
    if interface is None:
        yield
        return
    previous = os.environ.get(name)  # written here, and restored, never read elsewhere
    os.environ[name] = interface
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _loopback_interface() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def leave_parallel_group(tp: ParallelGroup, meet: bool = True) -> None:
    """Every rank meets once more, then destroys its process group: a rank that tears down
    gloo while a peer is still using the connection can abort at exit ("terminate called
    without an active exception"). A peer that is gone makes the barrier time out, not hang."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if meet and tp.world_size > 1:
        try:
            dist.monitored_barrier(group=tp.cpu_group, timeout=datetime.timedelta(seconds=10))
        except Exception:  # a peer died or already left
            pass
    dist.destroy_process_group()


def _group_from_store(backend: str, store: dist.Store, rank: int, world_size: int,
                      timeout: datetime.timedelta, loopback: bool) -> ParallelGroup:
    """The process group over ``store`` (plus a gloo group for CPU objects when the device
    backend is not gloo); a failed start leaves no half-made default group behind."""
    import torch.distributed as dist

    try:
        with _gloo_on_loopback(loopback):
            dist.init_process_group(backend=backend, store=store, rank=rank,
                                    world_size=world_size, timeout=timeout)
            world = dist.group.WORLD
            cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo",
                                                                       timeout=timeout)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return ParallelGroup(rank=rank, world_size=world_size, device_group=world,
                         cpu_group=cpu_group)
