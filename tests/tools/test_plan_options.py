"""`qwenserve plan` with serve's --mamba-ssm-cache-dtype, --enable-expert-parallel and
--hf-overrides: the same arithmetic as the engine, and the flags carried into the commands."""

from __future__ import annotations

import json

from plan_configs import text_config, write_model

from qwenserve.entrypoints.cli import main


def plan(capsys, path: str, *argv: str) -> tuple[int, dict]:
    code = main(["plan", path, *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_half_width_ssm_state_halves_its_bytes(tmp_path, capsys):
    c = text_config("Qwen3.5-27B")
    path = write_model(tmp_path, "Qwen3.5-27B")
    args = ("--max-model-len", "32768", "--device", "h200", "--tp", "2")
    _, f32 = plan(capsys, path, *args)
    _, f16 = plan(capsys, path, *args, "--mamba-ssm-cache-dtype", "float16")
    linear_layers = sum(t == "linear_attention" for t in c["layer_types"])
    ssm = c["linear_num_value_heads"] // 2 * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    f32_plan, f16_plan = f32["plans"][0], f16["plans"][0]
    saved = f32_plan["state_bytes_per_sequence"] - f16_plan["state_bytes_per_sequence"]
    assert saved == linear_layers * ssm * 2  # 4 -> 2 bytes per SSM element
    assert "--mamba-ssm-cache-dtype float16" in f16["commands"]["qwenserve"]
    assert "--mamba-ssm-cache-dtype float16" in f16["commands"]["vllm"]



def test_auto_ssm_state_is_the_checkpoints_dtype(tmp_path, capsys):
    """--mamba-ssm-cache-dtype auto counts the state in the checkpoint's mamba_ssm_dtype, as
    the engine keeps it (float32 in Qwen3.5's config.json; bf16 here through --hf-overrides)."""
    path = write_model(tmp_path, "Qwen3.5-27B")
    args = ("--max-model-len", "32768", "--device", "h200", "--tp", "2")
    _, declared = plan(capsys, path, *args)
    _, bf16 = plan(capsys, path, *args, "--hf-overrides", '{"mamba_ssm_dtype": "bfloat16"}')
    _, flag = plan(capsys, path, *args, "--mamba-ssm-cache-dtype", "bfloat16")
    assert declared["mamba_ssm_cache_dtype"] == "float32"
    assert bf16["mamba_ssm_cache_dtype"] == "bfloat16"
    assert bf16["plans"][0]["state_bytes_per_sequence"] == \
        flag["plans"][0]["state_bytes_per_sequence"] < \
        declared["plans"][0]["state_bytes_per_sequence"]


def test_expert_parallel_weights_and_commands(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen3-30B-A3B")  # 128 experts: 32 whole ones per device at TP=4
    args = ("--max-model-len", "32768", "--device", "910b-64g", "--tp", "4")
    _, tp = plan(capsys, path, *args)
    _, ep = plan(capsys, path, *args, "--enable-expert-parallel")
    # whole experts or slices of every expert: the same bytes per device when experts divide
    assert ep["plans"][0]["weight_bytes_per_device"] == tp["plans"][0]["weight_bytes_per_device"]
    assert "--enable-expert-parallel" in ep["commands"]["qwenserve"]
    assert "--enable-expert-parallel" in ep["commands"]["vllm"]
    # 4 ranks do not divide 130 experts: the busiest rank holds 33 whole ones, half an expert
    # per MoE layer more than the 130/4 of every expert that tensor parallelism gives it
    c = text_config("Qwen3-30B-A3B")
    odd = write_model(tmp_path / "odd", "Qwen3-30B-A3B", num_experts=130)
    _, tp = plan(capsys, odd, *args)
    _, ep = plan(capsys, odd, *args, "--enable-expert-parallel")
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2  # bf16 gate, up, down
    extra = ep["plans"][0]["weight_bytes_per_device"] - tp["plans"][0]["weight_bytes_per_device"]
    assert extra == c["num_hidden_layers"] * expert // 2


def test_yarn_override_extends_the_default_context(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen3-8B")  # max_position_embeddings 40960
    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 4,
                                "original_max_position_embeddings": 32768}}
    _, report = plan(capsys, path, "--device", "910b-64g", "--tp", "1",
                     "--hf-overrides", json.dumps(yarn))
    assert report["max_model_len"] == 131072  # 32768 x 4, as vLLM derives it
    assert "--hf-overrides" in report["commands"]["vllm"]
    code = main(["plan", path, "--device", "910b-64g", "--tp", "1", "--max-model-len", "131072",
                 "--json"])
    assert code == 2 and "YaRN" in capsys.readouterr().out
