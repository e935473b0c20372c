"""DPCoreClient: N engine replicas (data-parallel ranks) behind one ``AsyncEngine``.

    AsyncEngine --send--> DPCoreClient --AddRequest--> replica chosen by DPRouter (load, prefix)
                                       --Abort-------> the replica that holds the request
                                       --UtilityCall-> every replica; one combined answer
    AsyncEngine <--on_step-- each replica's StepOutputs, stats labelled with its rank

Local replicas are engine-core processes of this host (``ProcCoreClient``, each with its own
cores and devices); remote ones run on ``--headless`` nodes and joined over TCP
(``dp_remote.py``). Each replica is a whole engine (tensor parallel inside if asked), so a
replica that dies is the engine dying: the server follows today's single-engine policy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from qwenserve import envs
from qwenserve.config import DataParallelRank
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.core_binding import parse_cores, usable_cores
from qwenserve.engine.core_client import (
    EngineStartupError,
    OutputSink,
    ProcCoreClient,
)
from qwenserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    Command,
    EngineReady,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from qwenserve.engine.dp_config import DataParallelConfig
from qwenserve.engine.dp_router import DPRouter
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    from torch.distributed import TCPStore

logger = init_logger(__name__)

# How the replicas' answers to one utility call combine into the caller's one answer.
_COMBINE: dict[str, Callable[[list[object]], object]] = {
    "reset_prefix_cache": lambda values: all(bool(v) for v in values),
    "get_num_unfinished_requests": lambda values: sum(int(str(v)) for v in values),
    "has_unfinished_requests": lambda values: any(bool(v) for v in values),
}


class Replica(Protocol):
    """One engine (a local process, or a remote node's over TCP), as the client drives it."""

    ready: EngineReady

    def start(self, sink: OutputSink) -> None: ...

    def send(self, command: Command) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class _Gather:
    name: str
    remaining: int
    values: list[object] = field(default_factory=list)
    error: object = None


class _ReplicaSink:
    """What one replica reports to, tagged with its rank."""

    def __init__(self, client: DPCoreClient, index: int) -> None:
        self.client = client
        self.index = index

    def on_step(self, step: StepOutputs) -> None:
        self.client._on_step(self.index, step)

    def on_dead(self, message: str) -> None:
        self.client._on_dead(self.index, message)


class DPCoreClient:
    """Several replicas as one ``CoreClient``."""

    def __init__(self, replicas: dict[int, Replica], first_local: int,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self.replicas = dict(sorted(replicas.items()))
        self._on_shutdown = on_shutdown
        first = replicas[first_local]
        assert isinstance(first, ProcCoreClient)  # the head runs a rank itself
        self.ready: EngineReady = first.ready
        self.checks = first.checks
        self.tokenizer: Any = first.tokenizer
        self.router = DPRouter(tuple(self.replicas), self.ready.config.cache.block_size,
                               prefix_affinity=self.ready.enable_prefix_caching)
        self._lock = threading.Lock()
        self._calls: dict[int, _Gather] = {}
        self._sink: OutputSink | None = None
        self._closing = False
        self.moe_group_store: TCPStore | None = None  # DP x EP: the replicas' rendezvous store

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        return tuple(self.replicas)

    def start(self, sink: OutputSink) -> None:
        self._sink = sink
        for index, replica in self.replicas.items():
            replica.start(_ReplicaSink(self, index))

    def send(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            with self._lock:
                index = self.router.route(command.request_id, command.prompt_token_ids)
            self.replicas[index].send(command)
        elif isinstance(command, AbortRequests):
            by_replica: dict[int, list[str]] = {}
            with self._lock:
                for request_id in command.request_ids:
                    index = self.router.owner(request_id)
                    self.router.finished(request_id)
                    if index is not None:
                        by_replica.setdefault(index, []).append(request_id)
            for index, request_ids in by_replica.items():
                self.replicas[index].send(AbortRequests(request_ids))
        elif isinstance(command, UtilityCall):
            with self._lock:
                self._calls[command.call_id] = _Gather(command.name, len(self.replicas))
            for replica in self.replicas.values():
                replica.send(command)
        else:
            for replica in self.replicas.values():
                replica.send(command)

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
        _in_parallel({i: r.shutdown for i, r in self.replicas.items()})
        if self._on_shutdown is not None:
            self._on_shutdown()

    # ---- the replicas' side (their receiving threads) ----------------------------------------
    def _on_step(self, index: int, step: StepOutputs) -> None:
        with self._lock:
            for stats in step.stats:
                stats.engine_index = index
                self.router.report(index, stats.num_waiting, stats.kv_cache_usage)
            for out in step.outputs:
                if out.finished:
                    self.router.finished(out.request_id)
            for request_id, _ in step.errors:
                self.router.finished(request_id)
            step.results = [r for r in map(self._gather, step.results) if r is not None]
        if self._sink is not None and step:
            self._sink.on_step(step)

    def _gather(self, result: UtilityResult) -> UtilityResult | None:
        """One replica's answer; the combined one once every replica has answered."""
        gather = self._calls.get(result.call_id)
        if gather is None:
            return result
        if result.ok:
            gather.values.append(result.value)
        elif gather.error is None:
            gather.error = result.value
        gather.remaining -= 1
        if gather.remaining:
            return None
        del self._calls[result.call_id]
        if gather.error is not None:
            return UtilityResult(result.call_id, False, gather.error)
        combine = _COMBINE.get(gather.name, lambda values: values[0])
        return UtilityResult(result.call_id, True, combine(gather.values))

    def _on_dead(self, index: int, message: str) -> None:
        with self._lock:
            if self._closing:
                return
        if self._sink is not None:
            self._sink.on_dead(f"data-parallel engine {index} died: {message}")


# ---- starting the replicas ---------------------------------------------------------------------
def start_dp_client(engine_args: EngineArgs, dp: DataParallelConfig) -> DPCoreClient:
    """Start this host's replicas and wait for the remote ones; all ready, or none left running."""
    from qwenserve.engine.dp_remote import RemoteReplicas

    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    bindings = replica_bindings(envs.cpu_omp_threads_bind(), usable_cores(), dp.size_local)
    device_envs = replica_device_envs(dp.size_local, tp)
    logger.info("Data parallelism: %d engine(s), rank(s) %s on this host%s", dp.size,
                _ranks(dp.local_ranks),
                f", rank(s) {_ranks(dp.remote_ranks)} joining at {dp.address}:{dp.rpc_port}"
                if dp.remote_ranks else "")
    remote = RemoteReplicas(dp) if dp.remote_ranks else None
    # DP x EP: the replicas form one MoE group; this process serves its rendezvous store.
    store, placements = _moe_group_placements(engine_args, dp)
    starters: dict[int, Callable[[], Replica]] = {
        rank: (lambda b=bindings[k], e=device_envs[k], r=rank: ProcCoreClient(
            engine_args.for_data_parallel_rank(r), b, e, placements.get(r)))
        for k, rank in enumerate(dp.local_ranks)
    }
    if remote is not None:
        for rank in dp.remote_ranks:
            starters[rank] = (lambda r=rank: remote.wait_ready(r))
    started, errors = _in_parallel(starters)
    if not errors:
        try:
            _check_same_model(started)
        except EngineStartupError as e:
            errors[dp.local_ranks[0]] = e
    if errors:
        _in_parallel({i: c.shutdown for i, c in started.items()})
        if remote is not None:
            remote.close_handshake()
        rank, error = min(errors.items())
        raise EngineStartupError(f"data-parallel engine {rank}: {error}") from error
    client = DPCoreClient(started, dp.local_ranks[0],
                          remote.close_handshake if remote is not None else None)
    client.moe_group_store = store  # kept alive while the replicas run
    return client


def _moe_group_placements(engine_args: EngineArgs, dp: DataParallelConfig
                          ) -> tuple[TCPStore | None, dict[int, DataParallelRank]]:
    """With --enable-expert-parallel, each local replica's rank in the MoE group over all
    replicas, and the store they meet at when this process serves it: on a loopback port when
    every replica is here, else on --data-parallel-address, port --data-parallel-rpc-port + 1,
    served by rank 0's process (a head, or the server of --data-parallel-rank 0)."""
    placements = moe_group_placements(engine_args, dp)
    if not placements:
        return None, {}
    from qwenserve.distributed.init import LOOPBACK, serve_store

    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    world = dp.size * tp
    logger.info("Expert parallelism over %d data-parallel replicas x %d rank(s): one MoE group "
                "of %d ranks, stepping together", dp.size, tp, world)
    if not dp.spans_processes:
        store, port = serve_store(world)
        return store, {rank: DataParallelRank(rank, dp.size, LOOPBACK, port)
                       for rank in placements}
    store = serve_store(world, host=dp.address, port=dp.moe_group_port)[0] \
        if 0 in dp.local_ranks else None
    return store, placements


def moe_group_placements(engine_args: EngineArgs, dp: DataParallelConfig
                         ) -> dict[int, DataParallelRank]:
    """Each local replica's place in the MoE group over the replicas (none without it)."""
    if dp.size == 1 or not getattr(engine_args, "enable_expert_parallel", False):
        return {}
    return {rank: DataParallelRank(rank, dp.size, dp.address, dp.moe_group_port)
            for rank in dp.local_ranks}


def replica_bindings(spec: str, available: list[int], num_local: int) -> list[str]:
    """Each local replica's ``QWENSERVE_CPU_OMP_THREADS_BIND``: its own contiguous cores.

    ``0-3|4-7`` (vLLM's form) gives each replica one list; ``auto``/``all``/a list is split
    evenly (``auto`` keeps the last core for the API process when there are 4 or more); with
    fewer cores than replicas, or ``nobind``, placement is left to OpenMP."""
    spec = spec.strip().lower()
    if num_local == 1:
        return [spec]
    if "|" in spec:
        parts = spec.split("|")
        if len(parts) != num_local:
            raise ValueError(f"QWENSERVE_CPU_OMP_THREADS_BIND={spec!r} has {len(parts)} "
                             f"'|'-separated core lists for {num_local} local data-parallel "
                             "engines; give one per engine")
        return parts
    if spec == "nobind":
        return [spec] * num_local
    cores = list(parse_cores(spec)) if spec not in ("auto", "all") else list(available)
    if spec == "auto" and len(cores) >= 4:
        cores = cores[:-1]
    if len(cores) < num_local:
        logger.warning("%d usable core(s) for %d local data-parallel engines: their threads are "
                       "not pinned", len(cores), num_local)
        return ["nobind"] * num_local
    per = len(cores) // num_local
    return [",".join(map(str, cores[k * per:(k + 1) * per])) for k in range(num_local)]


def replica_device_envs(num_local: int, tensor_parallel_size: int) -> list[dict[str, str]]:
    """On an accelerator, each local replica sees its own ``tensor_parallel_size`` devices."""
    if num_local == 1:
        return [{}]
    from qwenserve.platforms import resolve_platform

    platform = resolve_platform()
    name = platform.visible_devices_env
    if not platform.is_accelerator or not name:
        return [{} for _ in range(num_local)]
    given = envs.get(name)
    visible = given.split(",") if given else [str(i) for i in range(num_local *
                                                                    tensor_parallel_size)]
    if len(visible) < num_local * tensor_parallel_size:
        raise ValueError(f"{num_local} local data-parallel engines x tensor parallel size "
                         f"{tensor_parallel_size} need {num_local * tensor_parallel_size} "
                         f"devices; {name} shows {len(visible)}")
    tp = tensor_parallel_size
    return [{name: ",".join(visible[k * tp:(k + 1) * tp])} for k in range(num_local)]


def _in_parallel(calls: dict[int, Callable[[], Any]]
                 ) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Run each call on its own thread; (results, errors) by key."""
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(key: int, call: Callable[[], Any]) -> None:
        try:
            results[key] = call()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors[key] = e

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def _check_same_model(replicas: dict[int, Replica]) -> None:
    seen = {i: (r.ready.config.model.name, r.ready.config.model.max_model_len)
            for i, r in replicas.items()}
    first_rank, first = next(iter(seen.items()))
    for rank, model in seen.items():
        if model != first:
            raise EngineStartupError(
                f"data-parallel engine {rank} serves {model[0]} (max_model_len {model[1]}) but "
                f"engine {first_rank} serves {first[0]} (max_model_len {first[1]}); start "
                "every node with the same model and flags")


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks)) or "none"
