"""DPRouter (load balancing and prefix affinity) and the per-replica core and device split,
without processes."""

from __future__ import annotations

import pytest

from qwenserve.engine.core_messages import StepOutputs, UtilityCall, UtilityResult
from qwenserve.engine.dp_client import DPCoreClient, replica_bindings
from qwenserve.engine.dp_router import DPRouter

BLOCK = 4


def test_a_burst_alternates_and_finished_requests_free_their_engine():
    router = DPRouter((0, 1), BLOCK)
    chosen = [router.route(f"r{i}", [100 + i] * 3) for i in range(6)]  # no full block: no prefix
    assert chosen == [0, 1, 0, 1, 0, 1]
    for i in (0, 2, 4):
        router.finished(f"r{i}")
    assert router.in_flight(0) == 0 and router.in_flight(1) == 3
    assert router.route("next", [7]) == 0
    router.finished("unknown")  # an id it never routed (or already finished): nothing happens
    assert router.owner("next") == 0 and router.owner("r0") is None


def test_reported_queue_and_kv_usage_weigh_in():
    router = DPRouter((0, 1, 2), BLOCK)
    router.report(0, num_waiting=2, kv_cache_usage=0.1)
    router.report(1, num_waiting=0, kv_cache_usage=0.9)
    router.report(2, num_waiting=0, kv_cache_usage=0.2)
    assert router.route("a", [1]) == 2  # 0 has a queue; 2's cache is emptier than 1's
    assert router.load(0) == pytest.approx(6.1)


def test_a_shared_prefix_goes_to_the_engine_that_holds_it_unless_it_is_much_busier():
    router = DPRouter((0, 1), BLOCK, affinity_slack=2)
    prefix = list(range(10, 10 + 3 * BLOCK))
    assert router.route("first", [*prefix, 1]) == 0
    assert router.route("other", [99] * 8) == 1  # no shared prefix: least loaded
    router.finished("other")
    # 0 is busier (1 in flight vs 0), but within the slack: the prefix wins
    assert router.route("second", [*prefix, 2]) == 0
    assert router.route("third", [*prefix[:BLOCK], 5, 5, 5, 5]) == 0  # first block only
    # now 3 in flight on 0, 0 on 1: beyond the slack, so least loaded, which then holds it too
    assert router.route("fourth", [*prefix, 3]) == 1
    assert router.route("fifth", [*prefix, 4]) == 1


def test_prefix_affinity_off_and_the_prefix_map_is_bounded():
    off = DPRouter((0, 1), BLOCK, prefix_affinity=False)
    prefix = list(range(2 * BLOCK))
    assert [off.route(str(i), prefix) for i in range(4)] == [0, 1, 0, 1]
    small = DPRouter((0, 1), BLOCK, max_prefixes=3, affinity_blocks=2)
    for i in range(5):
        small.route(str(i), [i] * (2 * BLOCK))
    assert len(small._prefixes) == 3


def test_replica_bindings_split_the_cores():
    assert replica_bindings("auto", [0, 1], 2) == ["0", "1"]
    assert replica_bindings("auto", list(range(8)), 2) == ["0,1,2", "3,4,5"]  # 7 keeps the API
    assert replica_bindings("all", list(range(8)), 2) == ["0,1,2,3", "4,5,6,7"]
    assert replica_bindings("0-3|4-7", list(range(8)), 2) == ["0-3", "4-7"]
    assert replica_bindings("auto", [0], 2) == ["nobind", "nobind"]
    assert replica_bindings("auto", [0, 1], 1) == ["auto"]
    with pytest.raises(ValueError, match="one per engine"):
        replica_bindings("0-3|4-7", list(range(8)), 3)


class _FakeReplica:
    def __init__(self, ready) -> None:
        self.ready = ready
        self.sent: list = []

    def start(self, sink) -> None:
        self.sink = sink

    def send(self, command) -> None:
        self.sent.append(command)

    def shutdown(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.steps: list[StepOutputs] = []

    def on_step(self, step: StepOutputs) -> None:
        self.steps.append(step)

    def on_dead(self, message: str) -> None:
        raise AssertionError(message)


def test_utility_calls_go_to_every_replica_and_answer_once(monkeypatch):
    import qwenserve.engine.dp_client as dp_client

    monkeypatch.setattr(dp_client, "ProcCoreClient", _FakeReplica)

    class Ready:
        class config:
            class cache:
                block_size = BLOCK

        enable_prefix_caching = True

    replicas = {0: _FakeReplica(Ready), 1: _FakeReplica(Ready)}
    for r in replicas.values():
        r.checks = r.tokenizer = None
    client = DPCoreClient(replicas, 0)
    sink = _Sink()
    client.start(sink)
    client.send(UtilityCall(7, "get_num_unfinished_requests"))
    assert all(isinstance(r.sent[0], UtilityCall) for r in replicas.values())
    replicas[0].sink.on_step(StepOutputs(results=[UtilityResult(7, True, 2)]))
    assert sink.steps == []  # waits for the other replica
    replicas[1].sink.on_step(StepOutputs(results=[UtilityResult(7, True, 3)]))
    assert sink.steps[-1].results == [UtilityResult(7, True, 5)]
