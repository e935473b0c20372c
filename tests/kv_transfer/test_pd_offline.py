"""P/D between two offline engines in one process (seconds, no servers): greedy tokens through
a producer and a consumer equal the consumer's own, for a dense model and for a hybrid one
(Qwen3.5: the Gated DeltaNet state before the last prompt token travels with the
blocks); the producer's blocks and held state slot are freed once pulled."""

from __future__ import annotations

import pytest
from oai_server import free_port
from pd_helpers import kv_config

from qwenserve import LLM, SamplingParams
from qwenserve.kv_transfer.params import parse_kv_transfer_params

PROMPTS = [[7, 300, 12, 45, 99, 100, 5, 17, 23, 8, 64, 77, 300, 12, 7, 3, 150, 151, 9],
           [5, 9, 200, 201, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
            60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73]]


def _llm(model: str, role: str, port: int, prefix_caching: bool) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
               block_size=16, enable_prefix_caching=prefix_caching,
               kv_transfer_config=kv_config(role, port, role))


@pytest.mark.parametrize("arch, prefix_caching", [("qwen2", True), ("qwen3_5", True)])
def test_pd_offline_equals_single(tiny_model, arch, prefix_caching):
    model = tiny_model(arch)
    producer = _llm(model, "kv_producer", free_port(), prefix_caching)
    consumer = _llm(model, "kv_consumer", free_port(), prefix_caching)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = [o.outputs[0].token_ids for o in consumer.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy)]
    consumer.llm_engine.reset_prefix_cache()  # the pulled blocks, not cached ones, must serve
    hold = SamplingParams(temperature=0, max_tokens=1,
                          kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True}))
    answers = [o.kv_transfer_params for o in producer.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], hold)]
    assert all(a["remote_has_state"] == (arch != "qwen2") for a in answers)
    pulled = [consumer.generate([{"prompt_token_ids": p}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True,
        kv_transfer_params=a))[0].outputs[0].token_ids  # a dict, as the API passes it
        for p, a in zip(PROMPTS, answers, strict=True)]
    assert pulled == single
    engine = producer.llm_engine
    assert engine.has_kv_holds()
    for _ in range(100):  # the pulls were reported to the workers; a step frees the blocks
        engine.step()
        if not engine.has_kv_holds():
            break
    assert not engine.has_kv_holds() and engine.scheduler.cache.usage() == 0
    assert engine.scheduler.cache.states.usage() == 0
    for llm in (producer, consumer):
        llm.llm_engine.shutdown()
