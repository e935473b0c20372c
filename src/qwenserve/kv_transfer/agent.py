"""KVTransferAgent: one worker's side of P/D disaggregation, driven by the SchedulerOutput.

    apply(sched)      holds to serve (producer), holds taken back, pulls to start (consumer)
    collect(out)      pulls that ended and holds pulled since the last step -> ModelOutput

Under tensor parallelism every rank pulls and serves its own shard (port ``kv_port + rank``);
a pull or a send is reported only once every rank has done it (the ranks gather their events
each step over the CPU group), so neither side frees or uses blocks another rank still needs.

Pulls run on a small thread pool so the engine keeps stepping other requests meanwhile; they
write only into blocks the scheduler gave the pulling request, which nothing else reads until
the pull is reported done.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import zmq

from qwenserve import envs
from qwenserve.core.sched_output import KVPull, ModelOutput, SchedulerOutput
from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.kv_transfer.config import KVTransferConfig
from qwenserve.kv_transfer.heads import PullPart, pull_plan
from qwenserve.kv_transfer.transport import KVBlockServer, pull_blocks
from qwenserve.layers.caches import ModelCaches
from qwenserve.logger import init_logger

logger = init_logger(__name__)

IDLE_WAIT_S = 0.005  # a step with nothing to run waits this long for a transfer to end


class KVTransferAgent:
    def __init__(self, config: KVTransferConfig, caches: ModelCaches, block_size: int,
                 tp: ParallelGroup, num_kv_heads: int) -> None:
        self.config, self.caches, self.block_size = config, caches, block_size
        self.rank, self.tp_size, self.num_kv_heads = tp.rank, tp.world_size, num_kv_heads
        rank = tp.rank
        self._events: queue.SimpleQueue[tuple[str, str, str | None]] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="qwenserve-kv-pull")
        self._in_flight = 0
        self._reports: dict[tuple[str, str], tuple[int, str | None]] = {}  # ranks so far
        self.server = None
        if config.is_producer:
            address = f"tcp://{config.kv_ip or '*'}:{config.kv_port + rank}"
            self.server = KVBlockServer(caches, block_size, config.engine_id, address,
                                        lambda rid: self._events.put(("sent", rid, None)))

    def apply(self, sched: SchedulerOutput) -> None:
        if self.server is not None:
            for hold in sched.kv_holds:
                self.server.hold(hold.request_id, hold.block_ids, hold.state_slot)
            for request_id in sched.kv_releases:
                self.server.release(request_id)
        for pull in sched.kv_pulls:
            self._in_flight += 1
            self._pool.submit(self._pull, pull)

    def _parts(self, pull: KVPull) -> list[PullPart]:
        """Same TP on both sides: rank r pulls all of rank r's heads; else ``heads.py``."""
        if pull.remote.tp_size == self.tp_size:
            return [PullPart(self.rank, [], [], 1)]
        return pull_plan(self.rank, self.tp_size, pull.remote.tp_size, self.num_kv_heads)

    def _pull(self, pull: KVPull) -> None:
        remote, error, address = pull.remote, None, ""
        same_tp = remote.tp_size == self.tp_size
        try:
            for part in self._parts(pull):
                address = f"tcp://{remote.host}:{remote.port + part.remote_rank}"
                request = {"request_id": remote.request_id, "engine_id": remote.engine_id,
                           "block_ids": remote.block_ids[: len(pull.block_ids)],
                           "heads": None if same_tp else part.src, "expect": part.expect}
                pull_blocks(self._ctx, address, request, self.caches, pull.block_ids,
                            self.block_size, envs.kv_pull_timeout_s(), pull.state_slot,
                            None if same_tp else part.dst)
        except Exception as e:  # noqa: BLE001 - the request fails, the engine lives on
            error = str(e)
            logger.warning("KV pull of request %s from %s failed: %s", pull.request_id,
                           address, error)
        self._events.put(("pulled", pull.request_id, error))

    def collect(self, out: ModelOutput, idle: bool, tp: ParallelGroup = SINGLE) -> None:
        """Report what every rank has finished (a collective under TP: every rank calls it
        each step); a step with nothing to compute waits a little for its own events."""
        events = self._drain(idle)
        if tp.world_size > 1:
            events = [e for rank_events in tp.all_gather_object(events) for e in rank_events]
        for kind, request_id, error in events:
            count, first_error = self._reports.pop((kind, request_id), (0, None))
            count, first_error = count + 1, first_error or error
            if count < tp.world_size:
                self._reports[(kind, request_id)] = (count, first_error)
            elif kind == "sent":
                out.kv_sent.append(request_id)
            else:
                out.kv_pulls_done[request_id] = first_error

    def _drain(self, idle: bool) -> list[tuple[str, str, str | None]]:
        events = []
        waiting = idle and self._in_flight > 0
        while True:
            try:
                event = (self._events.get(timeout=IDLE_WAIT_S) if waiting
                         else self._events.get_nowait())
            except queue.Empty:
                return events
            waiting = False
            if event[0] == "pulled":
                self._in_flight -= 1
            events.append(event)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctx.destroy(linger=0)
