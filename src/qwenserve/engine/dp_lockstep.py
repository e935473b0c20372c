"""The engine-core loop of a data-parallel replica whose MoE layers span the replicas (DP x EP).

Every replica's forward pass takes part in each MoE layer's exchange, so the replicas step
together, as vLLM's do::

    each iteration, on every replica:
        take this replica's commands (waiting up to IDLE_POLL_MS when it has nothing to run)
        [has work, stopping] = max over replicas (one small all-reduce, gloo)
        stopping:        all shut down together (no replica is left waiting in a collective)
        has work here:   one engine step (exactly one forward pass, or an empty one)
        work elsewhere:  a dummy step: the MoE exchanges with zero tokens of its own
        no work at all:  nothing (idle gauges reported once)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import zmq

from qwenserve.distributed.parallel_group import ParallelGroup
from qwenserve.engine.core import EngineCore
from qwenserve.engine.core_messages import Command, StepOutputs

IDLE_POLL_MS = 10  # how long an idle replica waits for a command before meeting the others


def serve_in_lockstep(core: EngineCore, group: ParallelGroup, inbox: zmq.Socket,
                      send: Callable[[StepOutputs], None]) -> int:
    """Run until every replica agreed to stop (one of them was told to); 0 when it did."""
    stopping = False
    while True:
        timeout_ms = 0 if core.engine.has_unfinished_requests() else IDLE_POLL_MS
        while not stopping and inbox.poll(timeout_ms):
            command: Command = pickle.loads(inbox.recv())
            stopping = not core.apply(command)
            timeout_ms = 0
        here = core.has_step_to_run()
        any_work, stop = group.max_flags([int(here), int(stopping)])
        if stop:
            core.engine.shutdown()
            return 0
        out = core.run_once(step_with_peers=bool(any_work))
        if out:
            send(out)
