"""The P/D pair of vLLM Ascend's Qwen3.5-397B-A17B guide (MooncakeLayerwiseConnector, expert
parallelism, a hybrid MoE model) runs: its producer and consumer commands, parsed by the serve
parser, start two offline engines on a tiny random Qwen3.5-MoE, and a prompt's KV and state move
from one to the other with the same greedy output as the consumer alone.

Shrunk as the tiny model and one process require, and only that: the model path,
``--tensor-parallel-size`` and the JSON's ``tp_size`` 16 -> 1 (two TP engines cannot share a
process; test_pd_tensor_parallel.py covers -tp 2), the context length, a KV budget, distinct
free kv_ports, ``--quantization ascend`` dropped (a float checkpoint) and
``--speculative-config`` (its MTP method is other work) dropped."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from oai_server import free_port

from helpers.tiny_models import add_mtp_head
from qwenserve import LLM, SamplingParams
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.entrypoints.openai.cli_args import make_serve_parser
from qwenserve.kv_transfer.params import parse_kv_transfer_params

CORPUS = json.loads((Path(__file__).parents[1] / "entrypoints" / "openai" / "data"
                     / "vllm_ascend_qwen_serve_commands.json").read_text())
GUIDE = "docs/source/tutorials/models/Qwen3.5-397B-A17B.md"
PROMPT = [7, 300, 12, 45, 99, 100, 5, 17, 23, 8, 64, 77, 300, 12, 7, 3, 150, 151, 9, 31, 2, 6]


def engine(model: str, line: int, mtp: bool = False) -> LLM:
    entry = next(c for c in CORPUS["commands"] if c["file"] == GUIDE and c["line"] == line)
    argv, out, skip = shlex.split(entry["command"])[3:], [], False
    dropped = ("--host", "--port", "--quantization") + (() if mtp else ("--speculative-config",))
    for arg in argv:
        if skip:
            skip = False
        elif arg in dropped:
            skip = True
        else:  # the guide's ${IP_ADDRESS}
            out.append("127.0.0.1" if arg.startswith("$") else arg)
    args = EngineArgs.from_cli_args(make_serve_parser().parse_args([model, *out]))
    args.model = model  # the positional model_tag, as the server resolves it
    kv = args.kv_transfer_config
    assert kv["kv_connector"] == "MooncakeLayerwiseConnector" and args.enable_expert_parallel
    for side in ("prefill", "decode"):
        kv["kv_connector_extra_config"][side]["tp_size"] = 1
    kv["kv_port"] = free_port()
    args.tensor_parallel_size, args.max_model_len = 1, 1024
    args.kv_cache_memory_bytes, args.dtype = 64 << 20, "float32"
    return LLM(**vars(args))


@pytest.mark.parametrize("mtp", [False, True])
def test_qwen3_5_moe_layerwise_pair(tiny_model, mtp):
    """With ``mtp`` the guide's ``qwen3_5_mtp`` speculative decoding runs on both sides too (the
    MTP layer's KV shares the target's blocks, so it travels with them)."""
    model = tiny_model("qwen3_5_moe")
    if mtp:  # its own copy: add_mtp_head writes into the checkpoint
        model = add_mtp_head(tiny_model("qwen3_5_moe", seed=7))
    producer, consumer = engine(model, 465, mtp), engine(model, 541, mtp)
    assert producer.llm_engine.config.model.architecture == "Qwen3_5MoeForCausalLM"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    single = consumer.generate([{"prompt_token_ids": PROMPT}], greedy)[0].outputs[0].token_ids
    hold = SamplingParams(temperature=0, max_tokens=1,
                          kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True}))
    answer = producer.generate([{"prompt_token_ids": PROMPT}], hold)[0].kv_transfer_params
    pulled = consumer.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True,
        kv_transfer_params=parse_kv_transfer_params(answer)))[0].outputs[0].token_ids
    assert pulled == single
    for llm in (producer, consumer):
        llm.llm_engine.shutdown()
