"""`qwenserve plan` on the published shapes of Qwen2.5, Qwen3, Qwen3-MoE and Qwen3.5 (dense and
MoE, nested ``text_config``): every figure is recomputed here from the shapes alone."""

from __future__ import annotations

import json
import shlex

import pytest
from plan_configs import CONFIGS, PUBLISHED_PARAMS, text_config, write_model

from qwenserve.entrypoints.cli import main
from qwenserve.entrypoints.openai.cli_args import make_serve_parser
from qwenserve.tools.plan.devices import DEVICES, RUNTIME_OVERHEAD_BYTES

GIB, MIB = 1 << 30, 1 << 20
ROTARY_TABLES_MAX = 8 * MIB  # cos/sin buffers: the only bytes that are not parameters


def plan(capsys, path: str, *argv: str) -> tuple[int, dict]:
    code = main(["plan", path, *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_tp(report: dict) -> dict[int, dict]:
    return {p["tp"]: p for p in report["plans"]}


def dense_shapes(name: str) -> dict:
    c = text_config(name)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return dict(v=c["vocab_size"], h=c["hidden_size"], layers=c["num_hidden_layers"],
                q=c["num_attention_heads"] * head_dim, kv=c["num_key_value_heads"] * head_dim,
                inter=c["intermediate_size"], tied=c["tie_word_embeddings"])  # fmt: skip


def dense_linear_params(s: dict) -> tuple[int, int]:
    """(weight-matrix elements, output rows) of the attention and MLP projections."""
    per_layer = s["h"] * (2 * s["q"] + 2 * s["kv"]) + 3 * s["h"] * s["inter"]
    rows = s["q"] + 2 * s["kv"] + s["h"] + 2 * s["inter"] + s["h"]
    return s["layers"] * per_layer, s["layers"] * rows


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_weights_are_the_published_parameter_count(tmp_path, capsys, name):
    """bfloat16 weights = 2 bytes x the Hub's parameter count: tied embeddings counted once,
    GQA projections, Qwen2's q/k/v biases, Qwen3's q/k norms and the 128 MoE experts."""
    _, report = plan(capsys, write_model(tmp_path, name), "--tp", "1", "--max-model-len", "4096",
                     "--device", "h200")  # fmt: skip
    extra = by_tp(report)[1]["weight_bytes_per_device"] - 2 * PUBLISHED_PARAMS[name]
    assert 0 <= extra <= ROTARY_TABLES_MAX


@pytest.mark.parametrize("name", ["Qwen2.5-7B", "Qwen3-8B"])
def test_quantized_widths_leave_embeddings_and_norms_alone(tmp_path, capsys, name):
    path, s = write_model(tmp_path, name), dense_shapes(name)
    linear, rows = dense_linear_params(s)

    def weights(*flags: str) -> int:
        _, report = plan(capsys, path, "--tp", "1", "--max-model-len", "4096", *flags)
        return by_tp(report)[1]["weight_bytes_per_device"]

    float_bytes = weights()
    rest = float_bytes - 2 * linear  # embeddings, lm_head, norms, biases, rotary tables
    assert rest >= s["v"] * s["h"] * (1 if s["tied"] else 2) * 2
    scales = rows * 4  # one float32 scale per output channel
    assert weights("--quantization", "w8a8") == linear + scales + rest
    assert weights("--quantization", "fp8") == linear + scales + rest
    group_bytes = int(linear * (0.5 + 2.5 / 128)) + scales + rest  # 4-bit + group scales/zeros
    assert abs(weights("--quantization", "awq") - group_bytes) < s["layers"] * 8  # rounding


@pytest.mark.parametrize(
    "name",
    [
        "Qwen2.5-7B",
        "Qwen2.5-32B",
        "Qwen2.5-72B",
        "Qwen3-32B",
        "Qwen3-30B-A3B",
        "Qwen3.5-27B",
        "Qwen3.5-35B-A3B",
    ],
)
def test_kv_bytes_per_token_use_kv_heads_split_over_tp(tmp_path, capsys, name):
    c = text_config(name)
    full_layers = sum(t == "full_attention" for t in c.get("layer_types", [])) or \
        c["num_hidden_layers"]  # fmt: skip
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    _, report = plan(capsys, write_model(tmp_path, name), "--max-model-len", "8192")
    assert report["plans"], report
    for tp, p in by_tp(report).items():
        kv_heads = max(1, c["num_key_value_heads"] // tp)  # replicated when TP > KV heads
        assert p["kv_bytes_per_token"] == 2 * full_layers * kv_heads * head_dim * 2, tp
        assert c["num_attention_heads"] % tp == 0


def test_qwen25_32b_kv_is_five_times_smaller_than_the_attention_head_formula(tmp_path, capsys):
    _, report = plan(capsys, write_model(tmp_path, "Qwen2.5-32B"), "--tp", "1")
    assert by_tp(report)[1]["kv_bytes_per_token"] * 5 == 2 * 64 * 40 * 128 * 2


@pytest.mark.parametrize("name", ["Qwen3.5-27B", "Qwen3.5-35B-A3B"])
def test_deltanet_state_per_sequence(tmp_path, capsys, name):
    """Per DeltaNet layer and sequence: the causal-conv tail (kernel-1 rows of q|k|v channels,
    model dtype) and the float32 SSM state (value heads x key dim x value dim)."""
    c = text_config(name)
    linear_layers = sum(t == "linear_attention" for t in c["layer_types"])
    path = write_model(tmp_path, name)
    _, report = plan(capsys, path, "--max-model-len", "32768", "--device", "h200")
    _, fp8 = plan(capsys, path, "--max-model-len", "32768", "--device", "h200",
                  "--kv-cache-dtype", "fp8")  # fmt: skip
    for tp, p in by_tp(report).items():
        conv = (
            2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
            + c["linear_num_value_heads"] * c["linear_value_head_dim"]
        ) // tp
        ssm = c["linear_num_value_heads"] // tp * c["linear_key_head_dim"] \
            * c["linear_value_head_dim"]  # fmt: skip
        expected = linear_layers * ((c["linear_conv_kernel_dim"] - 1) * conv * 2 + ssm * 4)
        assert p["state_bytes_per_sequence"] == expected, tp
        # an fp8 KV cache halves K/V only; the recurrent state keeps its dtypes
        assert by_tp(fp8)[tp]["state_bytes_per_sequence"] == expected
        assert by_tp(fp8)[tp]["kv_bytes_per_token"] * 2 == p["kv_bytes_per_token"]
        # a slot per --max-num-seqs sequence + the null slot, in at most half the budget
        assert p["num_state_slots"] == min(257, p["kv_cache_budget_bytes"] // 2 // expected)
    assert report["architecture"].endswith("ForConditionalGeneration")


@pytest.mark.parametrize("device", sorted(set(DEVICES) - {"cpu"}))
def test_capacity_concurrency_and_longest_length_on_every_preset(tmp_path, capsys, device):
    code, report = plan(capsys, write_model(tmp_path, "Qwen3-8B"), "--device", device,
                        "--tp", "1", "--max-model-len", "32768")  # fmt: skip
    preset, p = DEVICES[device], by_tp(report)[1]
    assert report["device_memory_bytes"] == preset.memory_bytes
    block = 128 if preset.kind == "npu" else 16
    assert report["block_size"] == block
    budget = (
        int(preset.memory_bytes * 0.9)
        - p["weight_bytes_per_device"]
        - p["activation_reserve_bytes"]
        - RUNTIME_OVERHEAD_BYTES[preset.kind]
    )
    assert p["kv_cache_budget_bytes"] == budget
    per_token = 2 * 36 * 8 * 128 * 2
    capacity = budget // (block * per_token) * block
    assert p["kv_token_capacity"] == p["largest_max_model_len"] == capacity
    assert p["max_concurrency"] == round(capacity / 32768, 2)
    assert (code == 0) == report["fits"] == (capacity >= 32768)


def test_device_memory_overrides_the_preset(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen2.5-32B")
    _, report = plan(capsys, path, "--device-memory", "48GiB", "--tp", "2")
    assert report["device_memory_bytes"] == 48 * GIB and report["block_size"] == 128
    p = by_tp(report)[2]
    assert p["kv_cache_budget_bytes"] == (
        int(48 * GIB * 0.9) - p["weight_bytes_per_device"] - p["activation_reserve_bytes"] - 2 * GIB
    )
    _, cuda = plan(capsys, path, "--device", "a100-80g", "--device-memory", "48GiB", "--tp", "2")
    assert cuda["block_size"] == 16 and cuda["device_memory_bytes"] == 48 * GIB


@pytest.mark.parametrize("target", [1, 8, 24])
def test_the_smallest_tp_that_reaches_the_target_concurrency(tmp_path, capsys, target):
    code, report = plan(capsys, write_model(tmp_path, "Qwen2.5-72B"), "--max-model-len", "32768",
                        "--target-concurrency", str(target))  # fmt: skip
    reaching = [tp for tp, p in by_tp(report).items() if p.get("max_concurrency", 0) >= target]
    assert report["chosen_tp"] == min(reaching) and code == 0
    assert f"--tensor-parallel-size {min(reaching)} " in report["commands"]["qwenserve"]
    assert sorted(by_tp(report)) == [1, 2, 4, 8, 16]


def test_no_tp_reaches_the_target_and_the_sentence_says_what_to_do(tmp_path, capsys):
    code, report = plan(capsys, write_model(tmp_path, "Qwen2.5-72B"), "--max-model-len", "32768",
                        "--target-concurrency", "1000")  # fmt: skip
    assert code == 1 and not report["fits"] and "commands" not in report
    explanation = report["explanation"]
    assert explanation.count(".") <= 3 and "below the target 1000" in explanation


def test_every_command_is_accepted_by_the_serve_parser(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen3-32B")
    for flags in (["--device", "910b-64g"], ["--device", "h100-80g", "--quantization", "int8"],
                  ["--device", "cpu", "--kv-cache-memory-bytes", "8G", "--max-model-len", "8k"],
                  ["--device", "a100-80g", "--max-num-batched-tokens", "8192",
                   "--block-size", "32", "--target-concurrency", "4"]):  # fmt: skip
        _, report = plan(capsys, path, *flags)
        argv = shlex.split(report["commands"]["qwenserve"])
        ns = make_serve_parser().parse_args(argv[2:])
        assert (ns.model_tag, ns.tensor_parallel_size) == (path, report["chosen_tp"])
        assert ns.max_model_len == report["max_model_len"]
        assert ns.block_size in (None, report["block_size"])
        assert shlex.split(report["commands"]["vllm"] or "vllm serve x")[:2] == ["vllm", "serve"]
        # CPU: the recorded decode steps' RAM is named beside the plan's figures
        replay_notes = [n for n in report["notes"] if "recorded decode steps" in n]
        assert len(replay_notes) == (flags[1] == "cpu") and all("256 MiB" in n
                                                                 for n in replay_notes)


def test_max_model_len_above_the_model_is_refused_as_serve_refuses_it(
    tmp_path, capsys, monkeypatch
):
    path = write_model(tmp_path, "Qwen2.5-7B")
    assert main(["plan", path, "--max-model-len", "65536"]) == 2
    assert "larger than the model's maximum of 32768" in capsys.readouterr().out
    monkeypatch.setenv("QWENSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    _, report = plan(capsys, path, "--max-model-len", "65536", "--tp", "1")
    assert report["max_model_len"] == 65536 and report["model_max_model_len"] == 32768


def test_tp_sizes_that_do_not_divide_the_heads_are_skipped_or_refused(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen2.5-7B")  # 28 attention heads, 4 KV heads
    _, report = plan(capsys, path)
    assert sorted(by_tp(report)) == [1, 2, 4]
    assert main(["plan", path, "--tp", "8"]) == 2
    assert "not divisible by --tensor-parallel-size 8" in capsys.readouterr().out


_CT_W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
                "dynamic": False}, "input_activations": {
                "num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                "dynamic": True}}}}  # fmt: skip
_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(("config", "width", "qwenserve_runs"), [
    (_CT_W8A8, "w8a8", True), (_AWQ, "awq", False), (_FP8, "fp8", False)])  # fmt: skip
def test_a_quantized_checkpoint_is_planned_at_its_own_width(
    tmp_path, capsys, config, width, qwenserve_runs
):
    float_path = write_model(tmp_path, "Qwen2.5-7B")
    quant_path = write_model(tmp_path / "q", "Qwen2.5-7B", quantization_config=config)
    _, flagged = plan(capsys, float_path, "--tp", "1", "--device", "h100-80g",
                      "--quantization", width)  # fmt: skip
    _, report = plan(capsys, quant_path, "--tp", "1", "--device", "h100-80g")
    assert report["quantization"] == width and report["quantization_from_checkpoint"]
    assert report["plans"][0]["weight_bytes_per_device"] == \
        flagged["plans"][0]["weight_bytes_per_device"]  # fmt: skip
    assert "--quantization" not in (report["commands"]["vllm"] or "")  # vLLM reads the config
    assert (report["commands"]["qwenserve"] is not None) == qwenserve_runs
    if not qwenserve_runs:
        assert any(n.startswith("no qwenserve command: The checkpoint is quantized with")
                   for n in report["notes"])  # fmt: skip


def test_a_modelslim_checkpoint_needs_quantization_ascend_on_vllm_ascend(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen2.5-7B")
    description = {
        "model_quant_type": "W8A8_DYNAMIC",
        "model.embed_tokens.weight": "FLOAT",
        "lm_head.weight": "FLOAT",
    }
    for layer in range(28):
        for proj in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            description[f"model.layers.{layer}.{proj}.weight"] = "W8A8_DYNAMIC"
    (tmp_path / "Qwen2.5-7B" / "quant_model_description.json").write_text(json.dumps(description))
    _, report = plan(capsys, path, "--tp", "1")
    assert report["quantization"] == "w8a8" and report["quantization_from_checkpoint"]
    assert report["commands"]["vllm"].endswith("--quantization ascend")
    assert "--quantization" not in report["commands"]["qwenserve"]  # detected at start-up


def test_commands_never_promise_what_a_server_cannot_do(tmp_path, capsys):
    path = write_model(tmp_path, "Qwen3-8B")
    _, fp8_kv = plan(capsys, path, "--device", "h100-80g", "--kv-cache-dtype", "fp8")
    assert fp8_kv["commands"]["qwenserve"] is None
    assert fp8_kv["commands"]["vllm"].endswith("--kv-cache-dtype fp8")
    _, int8 = plan(capsys, path, "--device", "910b-64g", "--quantization", "int8")
    assert int8["commands"]["vllm"] is None
    assert int8["commands"]["qwenserve"].endswith("--quantization int8")
    _, awq = plan(capsys, path, "--device", "910b-64g", "--quantization", "awq")
    assert awq["commands"] == {"qwenserve": None, "vllm": None} and len(awq["notes"]) == 3


def test_the_vision_tower_is_counted_in_the_model_dtype(tmp_path, capsys):
    """Qwen3.5's tower: HF's parameter count at 2 bytes, also under w8a8 (the engine does not
    quantize it); its activations on the largest image a step may encode add to the reserve."""
    import torch
    import transformers as tf

    path = write_model(tmp_path, "Qwen3.5-27B")
    cfg = tf.Qwen3_5VisionConfig(**CONFIGS["Qwen3.5-27B"]["vision_config"])
    with torch.device("meta"):
        hf = tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel._from_config(cfg)
    params = sum(p.numel() for p in hf.parameters())
    for flags in ((), ("--quantization", "w8a8")):
        _, report = plan(capsys, path, "--tp", "1", "--max-model-len", "4096", *flags)
        assert by_tp(report)[1]["vision_weight_bytes"] == 2 * params
    _, small = plan(capsys, path, "--tp", "1", "--max-model-len", "4096",
                    "--max-num-batched-tokens", "1024")
    _, large = plan(capsys, path, "--tp", "1", "--max-model-len", "4096",
                    "--max-num-batched-tokens", "2048")
    grow = by_tp(large)[1]["activation_reserve_bytes"] - by_tp(small)[1]["activation_reserve_bytes"]
    patches = 1024 * cfg.spatial_merge_size**2  # 1024 more language-model tokens of images
    assert grow > patches * 4 * cfg.hidden_size * 2


def test_mtp_adds_its_kv_layer_and_head_weights(tmp_path, capsys):
    """--speculative-config method mtp: one more paged KV layer (the head's attention) per
    token, and the head's weights (fc [H, 2H], one decoder layer, three norms)."""
    path = write_model(tmp_path, "Qwen3.5-27B")
    argv = ("--max-model-len", "32768", "--device", "h200", "--tp", "1")
    _, plain = plan(capsys, path, *argv)
    _, mtp = plan(capsys, path, *argv, "--speculative-config",
                  '{"method": "qwen3_5_mtp", "num_speculative_tokens": 3}')
    c = text_config("Qwen3.5-27B")
    full = sum(t == "full_attention" for t in c["layer_types"])
    p, m = by_tp(plain)[1], by_tp(mtp)[1]
    assert m["kv_bytes_per_token"] * full == p["kv_bytes_per_token"] * (full + 1)
    assert (m["weight_bytes_per_device"] - p["weight_bytes_per_device"]
            > 2 * c["hidden_size"] ** 2 * 2)
    assert "--speculative-config" in mtp["commands"]["qwenserve"]


def test_eagle3_head_counted_per_rank(tmp_path, capsys):
    """--speculative-config method eagle3: the head's weights (fc [H, 3H], a decoder layer whose
    q/k/v read 2H, its draft-vocabulary LM head) and one more paged KV layer, sharded per rank
    at TP=2 like the target's own layers (fc, norms and LM head replicated)."""
    path = write_model(tmp_path, "Qwen3-8B")
    c = text_config("Qwen3-8B")
    h, layers, kv = c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"]
    head = tmp_path / "head"  # the config is all the planner reads
    head.mkdir()
    (head / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h,
        intermediate_size=c["intermediate_size"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=kv, head_dim=c.get("head_dim"), num_hidden_layers=1,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        vocab_size=c["vocab_size"], draft_vocab_size=32000, target_hidden_size=h,
        tie_word_embeddings=False, torch_dtype="bfloat16")))
    head = str(head)
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    argv = ("--max-model-len", "32768", "--device", "h200")
    plans = {}
    for tp in (1, 2):
        _, plain = plan(capsys, path, *argv, "--tp", str(tp))
        _, eagle = plan(capsys, path, *argv, "--tp", str(tp), "--speculative-config", spec)
        p, e = by_tp(plain)[tp], by_tp(eagle)[tp]
        assert e["kv_bytes_per_token"] * layers == p["kv_bytes_per_token"] * (layers + 1)
        assert e["weight_bytes_per_device"] - p["weight_bytes_per_device"] \
            == e["speculative_head_weight_bytes"]
        assert "--speculative-config" in eagle["commands"]["qwenserve"]
        plans[tp] = e
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kvw, inter = c["num_attention_heads"] * head_dim, kv * head_dim, c["intermediate_size"]
    sharded = 2 * h * (q + 2 * kvw) + q * h + 3 * h * inter  # bf16 bytes / 2 per element
    replicated = 3 * h * h + 32000 * h + 4 * h  # fc, lm_head, norms (elements)
    assert plans[1]["speculative_head_weight_bytes"] >= 2 * (sharded + replicated)
    assert plans[1]["speculative_head_weight_bytes"] - plans[2]["speculative_head_weight_bytes"] \
        == sharded  # half of the sharded layers' bf16 bytes


@pytest.mark.parametrize("fmt", ["modelslim", "compressed-tensors"])
def test_int8_moe_experts_are_planned_at_one_byte_with_their_scales(tmp_path, capsys, fmt):
    """Qwen3-30B-A3B as vLLM Ascend's W8A8 checkpoints have it (attention W8A8, experts
    W8A8_DYNAMIC) or as llm-compressor writes it: every attention and expert matrix at one byte
    per element plus one float32 scale per output row, the routers in the model dtype; and
    qwenserve serves it (no refusal)."""
    c = text_config("Qwen3-30B-A3B")
    layers, hidden, inter, experts = (c["num_hidden_layers"], c["hidden_size"],
                                      c["moe_intermediate_size"], c["num_experts"])
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    attn_numel, attn_rows = (q + 2 * kv) * hidden + hidden * q, q + 2 * kv + hidden
    expert_numel, expert_rows = experts * 3 * inter * hidden, experts * (2 * inter + hidden)
    float_path = write_model(tmp_path, "Qwen3-30B-A3B")
    if fmt == "modelslim":
        quant_path = write_model(tmp_path / "q", "Qwen3-30B-A3B")
        desc = {"model_quant_type": "W8A8", "model.embed_tokens.weight": "FLOAT"}
        for layer in range(layers):
            for proj in ("q", "k", "v", "o"):
                desc[f"model.layers.{layer}.self_attn.{proj}_proj.weight"] = "W8A8"
            desc[f"model.layers.{layer}.mlp.gate.weight"] = "FLOAT"
            for e in range(experts):
                for proj in ("gate", "up", "down"):
                    desc[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = \
                        "W8A8_DYNAMIC"
        (tmp_path / "q" / "Qwen3-30B-A3B" / "quant_model_description.json").write_text(
            json.dumps(desc))
    else:
        config = {**_CT_W8A8, "ignore": ["lm_head", "re:.*mlp.gate$"]}
        quant_path = write_model(tmp_path / "q", "Qwen3-30B-A3B", quantization_config=config)
    args = ("--tp", "1", "--device", "h200", "--max-model-len", "4096")
    weights = {}
    for name, path, dtype in (("bf16", float_path, "bfloat16"), ("fp32", float_path, "float32"),
                              ("int8", quant_path, "bfloat16"),
                              ("int8-fp32", quant_path, "float32")):
        _, report = plan(capsys, path, *args, "--dtype", dtype)
        weights[name] = report["plans"][0]["weight_bytes_per_device"]
    numel, scales = layers * (attn_numel + expert_numel), layers * (attn_rows + expert_rows) * 4
    assert weights["bf16"] - weights["int8"] == numel * (2 - 1) - scales  # halved, scales added
    assert weights["fp32"] - weights["int8-fp32"] == numel * (4 - 1) - scales  # a quarter
    assert report["quantization"] == "w8a8" and report["quantization_from_checkpoint"]
    assert report["commands"]["qwenserve"] is not None  # served, not refused
    assert not any("MoE" in note for note in report["notes"])
