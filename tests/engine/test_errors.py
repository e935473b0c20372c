"""Bad models and bad inputs fail early with messages that name the file, numbers or fix."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.core.cache.plan import CacheTooSmallError
from qwenserve.engine.llm_engine import PromptTooLongError

HUGE = 1 << 50  # a KV budget that would fail if it were allocated before the check


def copy_model(src: str, dst) -> str:
    path = os.path.join(str(dst), "model")
    shutil.copytree(src, path)
    return path


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/no/such/model/dir")


def test_unsupported_architecture_lists_supported(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path)
    config = json.load(open(os.path.join(path, "config.json")))
    config["architectures"] = ["GPT2LMHeadModel"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError) as e:
        LLM(path, kv_cache_memory_bytes=HUGE)
    assert "GPT2LMHeadModel" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


def test_shard_named_in_index_but_missing(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    with pytest.raises(ValueError) as e:
        LLM(path, kv_cache_memory_bytes=HUGE)
    assert "model-00002-of-00002.safetensors" in str(e.value) and "missing" in str(e.value)


def test_truncated_safetensors(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path)
    shard = os.path.join(path, "model.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1000)
    with pytest.raises(ValueError) as e:
        LLM(path, kv_cache_memory_bytes=HUGE)
    assert "model.safetensors" in str(e.value) and "truncated" in str(e.value)


def test_corrupt_safetensors_header(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{{")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        LLM(path, kv_cache_memory_bytes=HUGE)


def test_weights_that_do_not_match_the_config(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path)
    config = json.load(open(os.path.join(path, "config.json")))
    config["intermediate_size"] = 96
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="shape"):
        LLM(path, kv_cache_memory_bytes=HUGE)


def test_kv_cache_too_small_gives_numbers_and_flags(tiny_model):
    with pytest.raises(CacheTooSmallError) as e:
        LLM(tiny_model("qwen2"), kv_cache_memory_bytes=64 * 1024, max_model_len=1024)
    msg = str(e.value)
    assert "max_model_len=1,024" in msg and "--kv-cache-memory-bytes" in msg


def test_max_model_len_beyond_the_model(tiny_model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(tiny_model("qwen2"), max_model_len=100_000)


def test_prompt_longer_than_max_model_len(tiny_model):
    llm = LLM(tiny_model("qwen2"), dtype="float32", max_model_len=64)
    with pytest.raises(PromptTooLongError) as e:
        llm.generate([{"prompt_token_ids": [1] * 65}], SamplingParams(max_tokens=4))
    assert "65" in str(e.value) and "64" in str(e.value)
    # the engine still serves normal requests afterwards
    out = llm.generate([{"prompt_token_ids": [1] * 10}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_out_of_vocabulary_token(tiny_model):
    llm = LLM(tiny_model("qwen2"), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 10**6]}])


def test_unknown_option():
    with pytest.raises(TypeError, match="swap_spaec"):
        LLM("x", swap_spaec=4)


def test_hub_id_offline_names_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        LLM("qwenserve-tests/does-not-exist")
    assert "local" in str(e.value) and "QWENSERVE_USE_MODELSCOPE" in str(e.value)
