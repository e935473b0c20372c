"""P/D between different tensor-parallel sizes (the guides' prefill tp 8 / decode tp 4, shrunk
to 2 and 1): each consumer rank gathers its KV heads from the producer ranks that hold them
(kv_transfer/heads.py). Offline engines in one process, one of them tensor-parallel at a time;
greedy output equals the consumer's own, and the producer's blocks are freed once pulled."""

from __future__ import annotations

import gc

import pytest
from pd_helpers import kv_config

from helpers.ports import free_port_block
from qwenserve import LLM, SamplingParams

PROMPT = [7, 300, 12, 45, 99, 100, 5, 17, 23, 8, 64, 77, 300, 12, 7, 3, 150, 151, 9, 31, 2, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def one_thread(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llm(model: str, role: str, tp: int) -> LLM:
    config = kv_config(role, free_port_block(tp), role, tp)  # rank r serves on port + r
    return LLM(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
               tensor_parallel_size=tp, kv_transfer_config=config)


def _transfer(producer: LLM, consumer: LLM) -> list[int]:
    hold = SamplingParams(temperature=0, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})
    answer = producer.generate([{"prompt_token_ids": PROMPT}], hold)[0].kv_transfer_params
    consumer.llm_engine.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            kv_transfer_params=answer)
    out = consumer.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    engine = producer.llm_engine
    for _ in range(200):  # every producer rank was pulled (or pinged): the blocks go
        engine.step()
        if not engine.has_kv_holds():
            break
    assert engine.scheduler.cache.usage() == 0
    return out


@pytest.mark.parametrize("tp_p, tp_c", [(2, 1), (1, 2)])
def test_different_tp(tiny_model, one_thread, tp_p, tp_c):
    model = tiny_model("qwen2")
    producer, consumer = _llm(model, "kv_producer", tp_p), _llm(model, "kv_consumer", tp_c)
    single = consumer.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    assert _transfer(producer, consumer) == single
    for llm in (producer, consumer):
        llm.llm_engine.shutdown()
    del producer, consumer
    gc.collect()
