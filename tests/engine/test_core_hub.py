"""CoreHub (``--api-server-count N``) over real ZeroMQ sockets, with a recording engine client:
ids renamed per API process and outputs routed back, utility calls, statistics to process 0
only, aborts when a process detaches, the engine's death told to every process."""

from __future__ import annotations

import pickle
import time

import pytest
import zmq

from qwenserve.engine.core_hub import Attach, CoreHub, Detach, HubHello
from qwenserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from qwenserve.outputs import RequestOutput
from qwenserve.sampling_params import SamplingParams


class RecordingCore:
    ready = "ready"  # what the hub hands each API process (opaque to it)
    engine_indexes = (0,)

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.sink = None

    def start(self, sink) -> None:
        self.sink = sink

    def send(self, command) -> None:
        self.sent.append(command)

    def shutdown(self) -> None:
        self.sent.append("shutdown")


class Api:
    """One API process's two sockets."""

    def __init__(self, ctx: zmq.Context, hub: CoreHub, index: int) -> None:
        self.push, self.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.push.connect(hub.addresses[index].commands)
        self.pull.connect(hub.addresses[index].outputs)

    def send(self, message: object) -> None:
        self.push.send(pickle.dumps(message))

    def recv(self, timeout_ms: int = 5000) -> object:
        assert self.pull.poll(timeout_ms), "nothing from the hub"
        return pickle.loads(self.pull.recv())

    def attach(self) -> HubHello:
        for _ in range(50):  # as HubCoreClient does: until the answer gets through
            self.send(Attach())
            if self.pull.poll(100):
                return pickle.loads(self.pull.recv())
        raise AssertionError("no HubHello")


@pytest.fixture
def hub():
    core = RecordingCore()
    hub = CoreHub(core, 2)
    hub.start()
    ctx = zmq.Context()
    yield hub, core, Api(ctx, hub, 0), Api(ctx, hub, 1)
    hub.shutdown()
    ctx.destroy(linger=0)


def _wait(core: RecordingCore, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(core.sent) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(core.sent) >= n, core.sent


def _out(request_id: str, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, None, [1], [], finished)


def test_routes_by_api_process_with_its_own_ids(hub):
    hub, core, a, b = hub
    core.sink.on_step(StepOutputs(stats=["early"]))  # before anyone attached: kept for 0
    assert a.attach().ready == "ready" and b.attach().engine_indexes == (0,)
    assert a.recv().stats == ["early"]
    params = SamplingParams(max_tokens=2)
    a.send(AddRequest("same", [1, 2], params, None, 0.0))
    b.send(AddRequest("same", [3], params, None, 0.0))
    b.send(UtilityCall(7, "reset_prefix_cache"))
    _wait(core, 3)
    ids = sorted(c.request_id for c in core.sent if isinstance(c, AddRequest))
    assert ids == ["0|same", "1|same"]
    call = next(c for c in core.sent if isinstance(c, UtilityCall))
    core.sink.on_step(StepOutputs(outputs=[_out("1|same", False), _out("0|same", True)],
                                  stats=["s"], results=[UtilityResult(call.call_id, True, 1)],
                                  errors=[("1|same", "refused")]))
    to_a, to_b = a.recv(), b.recv()
    assert [(o.request_id, o.finished) for o in to_a.outputs] == [("same", True)]
    assert to_a.stats == ["s"] and to_b.stats == []  # statistics: process 0 counts them
    assert [(o.request_id, o.finished) for o in to_b.outputs] == [("same", False)]
    assert to_b.results == [UtilityResult(7, True, 1)] and to_b.errors == [("same", "refused")]


def test_detach_aborts_what_is_left_and_death_reaches_everyone(hub):
    hub, core, a, b = hub
    a.attach(), b.attach()
    params = SamplingParams(max_tokens=2)
    for rid in ("x", "y"):
        b.send(AddRequest(rid, [1], params, None, 0.0))
    a.send(AddRequest("z", [1], params, None, 0.0))
    _wait(core, 3)
    b.send(AbortRequests(["x"]))
    _wait(core, 4)
    assert core.sent[-1] == AbortRequests(["1|x"])
    b.send(Detach())
    _wait(core, 5)
    assert core.sent[-1] == AbortRequests(["1|y"])  # x was aborted already; z is a's
    core.sink.on_dead("boom")
    assert a.recv() == EngineFailed("boom") and b.recv() == EngineFailed("boom")
