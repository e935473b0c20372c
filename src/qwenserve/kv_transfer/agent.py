"""KVTransferAgent: one worker's side of P/D disaggregation, driven by the SchedulerOutput.

    apply(sched)      holds to serve (producer), holds taken back, pulls to start (consumer)
    collect(out)      pulls that ended and holds pulled since the last step -> ModelOutput

Pulls run on a small thread pool so the engine keeps stepping other requests meanwhile; they
write only into blocks the scheduler gave the pulling request, which nothing else reads until
the pull is reported done.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from qwenserve import envs
from qwenserve.core.sched_output import KVPull, ModelOutput, SchedulerOutput
from qwenserve.kv_transfer.config import KVTransferConfig
from qwenserve.kv_transfer.transport import KVBlockServer, pull_blocks
from qwenserve.logger import init_logger

logger = init_logger(__name__)

IDLE_WAIT_S = 0.005  # a step with nothing to run waits this long for a transfer to end


class KVTransferAgent:
    def __init__(self, config: KVTransferConfig, kv: dict[int, torch.Tensor], block_size: int,
                 rank: int) -> None:
        self.config, self.kv, self.block_size, self.rank = config, kv, block_size, rank
        self._events: queue.SimpleQueue[tuple[str, str, str | None]] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="qwenserve-kv-pull")
        self._in_flight = 0
        self.server = None
        if config.is_producer:
            address = f"tcp://{config.kv_ip}:{config.kv_port + rank}"
            self.server = KVBlockServer(kv, block_size, config.engine_id, address,
                                        lambda rid: self._events.put(("sent", rid, None)))

    def apply(self, sched: SchedulerOutput) -> None:
        if self.server is not None:
            for hold in sched.kv_holds:
                self.server.hold(hold.request_id, hold.block_ids)
            for request_id in sched.kv_releases:
                self.server.release(request_id)
        for pull in sched.kv_pulls:
            self._in_flight += 1
            self._pool.submit(self._pull, pull)

    def _pull(self, pull: KVPull) -> None:
        remote = pull.remote
        address = f"tcp://{remote.host}:{remote.port + self.rank}"
        request = {"request_id": remote.request_id, "engine_id": remote.engine_id,
                   "block_ids": remote.block_ids[: len(pull.block_ids)]}
        error = None
        try:
            pull_blocks(self._ctx, address, request, self.kv, pull.block_ids, self.block_size,
                        envs.kv_pull_timeout_s())
        except Exception as e:  # noqa: BLE001 - the request fails, the engine lives on
            error = str(e)
            logger.warning("KV pull of request %s from %s failed: %s", pull.request_id,
                           address, error)
        self._events.put(("pulled", pull.request_id, error))

    def collect(self, out: ModelOutput, idle: bool) -> None:
        """Report what ended; a step with nothing to compute waits a little for it."""
        waiting = idle and self._in_flight > 0
        while True:
            try:
                kind, request_id, error = (self._events.get(timeout=IDLE_WAIT_S) if waiting
                                           else self._events.get_nowait())
            except queue.Empty:
                return
            waiting = False
            if kind == "sent":
                out.kv_sent.append(request_id)
            else:
                self._in_flight -= 1
                out.kv_pulls_done[request_id] = error

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctx.destroy(linger=0)
