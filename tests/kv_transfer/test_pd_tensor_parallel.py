"""P/D at --tensor-parallel-size 2 on both sides: each rank pulls its own KV shard from the
producer rank with the same index (kv_port + rank). The producer is an offline ``LLM`` in this
process (its ranks serve the held blocks with the engine idle), the consumer a real server; the
consumer's output equals its own single-server output."""

from __future__ import annotations

import httpx
import pytest
from oai_server import RemoteServer
from pd_helpers import kv_config, serve_args

from helpers.ports import free_port_block
from qwenserve import LLM, SamplingParams
from qwenserve.kv_transfer.params import parse_kv_transfer_params

PROMPT = [7, 300, 12, 45, 99, 100, 5, 17, 23, 8, 64, 77, 300, 12, 7, 3, 150, 151, 9, 31, 2]


@pytest.fixture
def one_thread(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.benchmark  # ~70 s on a loaded 2-core VM; test_pd_tp_mismatch.py covers TP P/D
def test_tp2_producer_to_tp2_consumer(pd_model, tmp_path, one_thread):
    consumer = RemoteServer(serve_args(pd_model, "kv_consumer", free_port_block(2), "d", tp=2),
                            tmp_path / "consumer.log", env={"OMP_NUM_THREADS": "1"})
    try:
        producer = LLM(pd_model, dtype="float32", max_model_len=256, tensor_parallel_size=2,
                       kv_cache_memory_bytes=16 << 20,
                       kv_transfer_config=kv_config("kv_producer", free_port_block(2), "p", tp=2))
        hold = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params=
                              parse_kv_transfer_params({"do_remote_decode": True}))
        kv = producer.generate([{"prompt_token_ids": PROMPT}], hold)[0].kv_transfer_params
        assert kv["tp_size"] == 2 and kv["remote_num_tokens"] == len(PROMPT)
        body = {"model": pd_model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True}
        url = consumer.base_url + "/v1/completions"
        single = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
        pd = httpx.post(url, json={**body, "kv_transfer_params": kv}, timeout=60)
        assert pd.status_code == 200, pd.text
        assert pd.json()["choices"][0]["text"] == single
        producer.llm_engine.shutdown()
    finally:
        consumer.stop()
