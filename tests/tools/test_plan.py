"""`qwenserve plan`: GQA arithmetic, the TP search and failed fits explained (the engine's
agreement is in test_plan_engine.py, published model shapes in test_plan_configs.py)."""

from __future__ import annotations

import json
import os

import pytest

from qwenserve.entrypoints.cli import main

GIB = 1 << 30


def plan_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def write_config(tmp_path, **overrides) -> str:
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
           "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
           "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}  # Qwen2.5-32B
    cfg.update(overrides)
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_qwen25_32b_gqa_kv_and_the_int8_fit(tmp_path, capsys):
    path = write_config(tmp_path)
    code, report = plan_json(capsys, path, "--device", "910b-64g", "--tp", "1",
                             "--max-model-len", "32768")
    plan = report["plans"][0]
    assert plan["kv_bytes_per_token"] == 262_144  # 8 KV heads, not 40 attention heads
    assert 60 * GIB < plan["weight_bytes_per_device"] < 62 * GIB
    assert code == 1 and not report["fits"] and "--quantization w8a8" in report["explanation"]
    code, report = plan_json(capsys, path, "--device", "910b-64g", "--tp", "1",
                             "--max-model-len", "32768", "--quantization", "w8a8")
    assert code == 0 and report["fits"]
    assert report["plans"][0]["weight_bytes_per_device"] < 34 * GIB
    assert "--quantization ascend" in report["commands"]["vllm"]


def test_smallest_tp_for_target_concurrency_and_kv_split(tmp_path, capsys):
    path = write_config(tmp_path)
    code, report = plan_json(capsys, path, "--device", "910b-64g", "--max-model-len", "32768",
                             "--target-concurrency", "8")
    by_tp = {p["tp"]: p for p in report["plans"]}
    assert by_tp[2]["kv_bytes_per_token"] == 131_072 and by_tp[8]["kv_bytes_per_token"] == 32_768
    assert report["chosen_tp"] == min(tp for tp, p in by_tp.items()
                                      if p.get("max_concurrency", 0) >= 8)
    assert "--tensor-parallel-size" in report["commands"]["qwenserve"]


def test_longest_sequence_explained(tmp_path, capsys):
    path = write_config(tmp_path)
    code, report = plan_json(capsys, path, "--device", "cpu", "--kv-cache-memory-bytes", "1G",
                             "--tp", "1", "--max-model-len", "32768", "--dtype", "bfloat16")
    assert code == 1
    assert report["plans"][0]["largest_max_model_len"] == 4096
    assert "4096" in report["explanation"] and "--max-model-len" in report["explanation"]


def test_human_output_and_bad_model(tmp_path, capsys):
    path = write_config(tmp_path)
    assert main(["plan", path, "--device", "h200", "--max-model-len", "8k"]) == 0
    out = capsys.readouterr().out
    assert "qwenserve serve" in out and "vllm serve" in out
    assert main(["plan", os.path.join(str(tmp_path), "missing")]) == 2
    assert "error:" in capsys.readouterr().out


@pytest.mark.parametrize("text,expected", [("48GiB", 48 * GIB), ("64GB", 64 * 10**9),
                                           ("1024", 1024)])
def test_device_memory_parsing(text, expected):
    from qwenserve.tools.plan.devices import parse_memory

    assert parse_memory(text) == expected
