"""AsyncEngine: concurrent streams equal offline results; abandoned streams free their blocks."""

from __future__ import annotations

import asyncio

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.async_engine import AsyncEngine
from qwenserve.sampling_params import RequestOutputKind

PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [7, 300, 12], [42] * 20]


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = AsyncEngine.from_engine_args(EngineArgs(model=tiny_model("qwen3"), dtype="float32",
                                                  max_model_len=256, max_num_batched_tokens=32))
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


def test_abandoned_stream_is_aborted_and_frees_blocks(engine):
    async def main():
        agen = engine.generate(PROMPTS[1], delta_params(max_tokens=200), "leaver")
        await agen.__anext__()
        await agen.aclose()  # what a client disconnect does to the handler
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.engine.cache.usage() == 0.0 and not engine.engine.has_unfinished_requests():
                return True
        return False

    assert asyncio.run(main())


def test_bad_request_fails_at_once_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            async for _ in engine.generate([1] * 300, delta_params(), "too-long"):
                pass
        return await collect(engine, PROMPTS[0], "after", delta_params(4))

    tokens, _ = asyncio.run(main())
    assert len(tokens) == 4 and engine.is_running
