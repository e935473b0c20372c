"""AsyncEngine with its engine core on a thread and in its own process: concurrent streams equal
offline results, abandoned streams free their blocks, bad requests fail at once, and a dead
engine fails every pending call at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.async_engine import AsyncEngine, EngineDeadError
from qwenserve.engine.core_client import EngineStartupError, ProcCoreClient
from qwenserve.sampling_params import RequestOutputKind

PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [7, 300, 12], [42] * 20]


class Stats:
    """A stat logger that keeps what the engine reported last."""

    def __init__(self) -> None:
        self.last = None

    def record(self, stats) -> None:
        self.last = stats


def engine_args(tiny_model) -> EngineArgs:
    return EngineArgs(model=tiny_model("qwen3"), dtype="float32", max_model_len=256,
                      max_num_batched_tokens=32, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request, tiny_model):
    stats = Stats()
    eng = AsyncEngine.from_engine_args(engine_args(tiny_model), stat_loggers=[stats],
                                       multiprocess=request.param == "process")
    eng.test_stats = stats
    yield eng
    eng.shutdown()


def delta_params(max_tokens=12):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


async def collect(engine, prompt, request_id, params):
    tokens, text = [], ""
    async for out in engine.generate(prompt, params, request_id):
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
    return tokens, text


def test_concurrent_streams_equal_offline(engine, tiny_model):
    async def main():
        return await asyncio.gather(*(collect(engine, p, f"req-{i}", delta_params())
                                      for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    llm = LLM(tiny_model("qwen3"), dtype="float32", max_model_len=256)
    offline = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [r[0] for r in results] == [o.outputs[0].token_ids for o in offline]
    assert [r[1] for r in results] == [o.outputs[0].text for o in offline]


def test_every_output_names_the_prompt_the_engine_ran(engine):
    """Outputs cross from the engine process without their prompt (output_wire.py)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            truncate_prompt_tokens=8, output_kind=RequestOutputKind.DELTA)

    async def main():
        return [o async for o in engine.generate(PROMPTS[1], params, "named", prompt="words")]

    outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
    assert all(o.prompt_token_ids == PROMPTS[1][-8:] and o.prompt == "words" for o in outs)


def test_abandoned_stream_is_aborted_and_frees_blocks(engine):
    async def main():
        agen = engine.generate(PROMPTS[1], delta_params(max_tokens=200), "leaver")
        await agen.__anext__()
        assert engine.test_stats.last.kv_cache_usage > 0
        await agen.aclose()  # what a client disconnect does to the handler
        for _ in range(100):
            await asyncio.sleep(0.02)
            last = engine.test_stats.last
            if last.kv_cache_usage == 0.0 and last.num_running == 0:
                return await engine.call_utility("get_num_unfinished_requests")
        return None

    assert asyncio.run(main()) == 0


def test_bad_request_fails_at_once_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            async for _ in engine.generate([1] * 300, delta_params(), "too-long"):
                pass
        with pytest.raises(RuntimeError, match="not an engine utility"):
            await engine.call_utility("shutdown")
        return await collect(engine, PROMPTS[0], "after", delta_params(4))

    tokens, _ = asyncio.run(main())
    assert len(tokens) == 4 and engine.is_running


def test_outputs_arrive_batched_per_step(engine):
    """Four streams in one batch: each step wakes the event loop once for all of them."""
    seen: list[int] = []
    original = engine.on_step

    def counting(step):
        if step.outputs:
            seen.append(len(step.outputs))
        original(step)

    async def main():
        await asyncio.gather(*(collect(engine, p, f"batch-{i}", delta_params(8))
                               for i, p in enumerate(PROMPTS)))

    engine.on_step = counting
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        del engine.on_step
    assert max(seen) == len(PROMPTS)


def _kill_engine(engine: AsyncEngine) -> None:
    if engine.multiprocess:
        os.kill(engine.core.pid, signal.SIGKILL)
    else:
        def boom():
            raise RuntimeError("injected step failure")

        engine.engine.step = boom


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_dead_engine_fails_every_pending_call_at_once(tiny_model, mode):
    stats = Stats()
    engine = AsyncEngine.from_engine_args(engine_args(tiny_model), stat_loggers=[stats],
                                          multiprocess=mode == "process")
    deaths = []
    engine.add_dead_callback(deaths.append)

    async def main():
        agen = engine.generate(PROMPTS[1], delta_params(max_tokens=10_000), "victim")
        await agen.__anext__()
        assert stats.last.num_running == 1
        _kill_engine(engine)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        waited = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.reset_prefix_cache(), 2)
        with pytest.raises(EngineDeadError):
            await collect(engine, PROMPTS[0], "late", delta_params())
        return waited

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) < 5
        deadline = time.monotonic() + 5
        while not deaths and time.monotonic() < deadline:  # called on the engine's side
            time.sleep(0.01)
        assert not engine.is_running and len(deaths) == 1
        assert stats.last.num_running == 0 and stats.last.kv_cache_usage == 0.0
    finally:
        engine.shutdown()


def test_engine_process_startup_error_is_one_clear_message(tmp_path):
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="no-such-model"):
        ProcCoreClient(EngineArgs(model=str(missing)))
    assert time.monotonic() - start < 120


def test_merge_deltas_concatenates_per_choice():
    from qwenserve.engine.async_engine import merge_deltas
    from qwenserve.outputs import CompletionOutput, Logprob, RequestOutput

    lp = [{1: Logprob(-0.1)}]
    a = RequestOutput("r", "p", [1], [CompletionOutput(0, "a", [1], -0.1, lp),
                                      CompletionOutput(1, "x", [9])], False, prompt_logprobs=[None])
    b = RequestOutput("r", "p", [1], [CompletionOutput(0, "b", [2], -0.3, lp, "length")], True,
                      num_cached_tokens=16)
    m = merge_deltas(a, b)
    assert [(c.index, c.text, c.token_ids) for c in m.outputs] == [(0, "ab", [1, 2]),
                                                                   (1, "x", [9])]
    assert m.outputs[0].logprobs == lp + lp and m.outputs[0].cumulative_logprob == -0.3
    assert m.outputs[0].finish_reason == "length" and m.finished
    assert m.prompt_logprobs == [None] and m.num_cached_tokens == 16


def test_slow_consumer_gets_one_output_per_wakeup_with_every_token(engine):
    """A consumer that stops reading while steps run gets the queued deltas merged into one
    output when it reads again, nothing lost."""

    async def main():
        agen = engine.generate(PROMPTS[2], delta_params(30), "slow")
        first = await agen.__anext__()
        for _ in range(3000):  # until the engine reports the request done
            await asyncio.sleep(0.01)
            if engine.test_stats.last.num_running == 0:
                break
        await asyncio.sleep(0.1)  # the last output lands just after the stats that report it
        rest = [out async for out in agen]
        return first.outputs[0].token_ids + rest[0].outputs[0].token_ids, len(rest)

    tokens, outputs = asyncio.run(main())
    fast, _ = asyncio.run(collect(engine, PROMPTS[2], "fast", delta_params(30)))
    assert tokens == fast and outputs == 1


def test_tensor_parallel_under_the_engine_process(tiny_model, monkeypatch):
    """The engine process is the rank-0 driver: TP=2 streams the tokens TP=1 gives offline."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on a shared CPU
    args = engine_args(tiny_model)
    args.tensor_parallel_size = 2
    engine = AsyncEngine.from_engine_args(args, multiprocess=True)
    try:
        assert "x 2 ranks" in engine.device_description
        tokens, _ = asyncio.run(collect(engine, PROMPTS[1], "tp", delta_params(8)))
    finally:
        engine.shutdown()
    llm = LLM(tiny_model("qwen3"), dtype="float32", max_model_len=256)
    offline = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert tokens == offline[0].outputs[0].token_ids
