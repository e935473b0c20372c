"""The checkpoint's quantization is detected, a contradicting ``--quantization`` fails, and
schemes qwenserve cannot run are refused with a message (no model is built here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from quant_writers import CT_W8A8_GROUP, ct_quantization_config

from qwenserve.quantization import resolve_quantization, schemes
from qwenserve.quantization.schemes import ct_scheme_for, modelslim_type_for


def hf_config(quantization_config=None, folder=""):
    cfg = SimpleNamespace(_name_or_path=str(folder))
    if quantization_config is not None:
        cfg.quantization_config = quantization_config
    return cfg


def modelslim_folder(tmp_path, **entries):
    desc = {"model_quant_type": "W8A8", "model.embed_tokens.weight": "FLOAT",
            "model.layers.0.self_attn.q_proj.weight": "W8A8",
            "model.layers.0.self_attn.k_proj.weight": "W8A8",
            "model.layers.0.self_attn.v_proj.weight": "W8A8",
            "model.layers.0.mlp.down_proj.weight": "FLOAT", **entries}
    (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    return tmp_path


# ---- detection and flags -------------------------------------------------------------------------
def test_float_checkpoint():
    assert resolve_quantization(hf_config(), None) == (None, None)
    assert resolve_quantization(hf_config(), "int8")[0] == "int8"
    with pytest.raises(ValueError, match="checkpoint is not quantized.*--quantization int8"):
        resolve_quantization(hf_config(), "compressed-tensors")


@pytest.mark.parametrize("flag", [None, "compressed-tensors", "w8a8"])
def test_compressed_tensors_is_detected(flag):
    method, config = resolve_quantization(hf_config(ct_quantization_config()), flag)
    assert method == "compressed-tensors" and config["ignore"] == ["lm_head"]


@pytest.mark.parametrize("flag, message", [
    ("int8", "already a compressed-tensors checkpoint"),
    ("ascend", "--quantization ascend contradicts the checkpoint, which is a compressed-tensors"),
])
def test_contradicting_flag_on_compressed_tensors(flag, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(hf_config(ct_quantization_config()), flag)


@pytest.mark.parametrize("flag", [None, "ascend", "w8a8"])
def test_modelslim_is_detected_from_its_description(tmp_path, flag):
    method, config = resolve_quantization(hf_config(folder=modelslim_folder(tmp_path)), flag)
    assert method == "ascend"
    assert config["description"]["model.layers.0.self_attn.q_proj.weight"] == "W8A8"


@pytest.mark.parametrize("flag", ["compressed-tensors", "int8"])
def test_contradicting_flag_on_modelslim(tmp_path, flag):
    with pytest.raises(ValueError, match="ModelSlim checkpoint"):
        resolve_quantization(hf_config(folder=modelslim_folder(tmp_path)), flag)


def test_quantized_moe_experts_load_but_quantized_gates_and_static_experts_are_refused(tmp_path):
    moe = hf_config({**ct_quantization_config(),
                     "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]})
    moe.num_experts = 8
    assert resolve_quantization(moe, None)[0] == "compressed-tensors"  # INT8 experts: loaded
    moe.quantization_config["ignore"] = ["lm_head"]  # "Linear" then covers the router too
    with pytest.raises(ValueError, match=r"mlp.gate \(a MoE router.*ignore list"):
        resolve_quantization(moe, None)
    expert = "model.layers.0.mlp.experts.0.up_proj.weight"
    folder = modelslim_folder(tmp_path, **{expert: "W8A8_DYNAMIC"})
    assert resolve_quantization(hf_config(folder=folder), "ascend")[0] == "ascend"
    for entries, message in (({expert: "W8A8"}, "static W8A8 activations"),
                             ({"model.layers.0.mlp.gate.weight": "W8A8_DYNAMIC"}, "MoE router"),
                             ({"model.layers.0.mlp.shared_expert_gate.weight": "W8A8"},
                              "MoE router or shared-expert gate")):
        folder = modelslim_folder(tmp_path, **entries)
        with pytest.raises(ValueError, match=message):
            resolve_quantization(hf_config(folder=folder), None)


def test_modelslim_expert_types():
    names = schemes.expert_weight_names("model.layers.2.mlp.experts", 2)
    assert names[0] == "model.layers.2.mlp.experts.0.gate_proj.weight" and len(names) == 6
    assert schemes.expert_weight_names("m.mlp.shared_expert", 1)[2] == \
        "m.mlp.shared_expert.down_proj.weight"
    desc = dict.fromkeys(names, "W8A8_DYNAMIC")
    assert schemes.modelslim_expert_type("model.layers.2.mlp.experts", 2, desc) == "W8A8_DYNAMIC"
    assert schemes.modelslim_expert_type("model.layers.3.mlp.experts", 2, desc) is None
    desc[names[-1]] = "FLOAT"
    with pytest.raises(ValueError, match="quantized differently"):
        schemes.modelslim_expert_type("model.layers.2.mlp.experts", 2, desc)


def test_other_methods_are_refused_not_loaded_as_float(tmp_path):
    with pytest.raises(ValueError, match="quantized with 'awq', which qwenserve cannot load"):
        resolve_quantization(hf_config({"quant_method": "awq", "bits": 4}), None)
    with pytest.raises(ValueError, match="has no quant_model_description.json"):
        resolve_quantization(hf_config({"quant_method": "ascend"}, tmp_path), None)


# ---- compressed-tensors schemes ------------------------------------------------------------------
W4 = dict(CT_W8A8_GROUP["weights"], num_bits=4, strategy="group", group_size=128)
FP8 = dict(CT_W8A8_GROUP["weights"], type="float")
STATIC = dict(CT_W8A8_GROUP["input_activations"], dynamic=False, strategy="tensor")
ASYM = dict(CT_W8A8_GROUP["input_activations"], symmetric=False)


@pytest.mark.parametrize("overrides, message", [
    (dict(weights=W4, format="pack-quantized"), "weights num_bits=4"),
    (dict(weights=FP8, format="float-quantized"), "weights type='float'"),
    (dict(input_activations=STATIC), "input_activations strategy='tensor'; input_activations "
                                     "dynamic=False"),
    (dict(input_activations=ASYM), "input_activations symmetric=False"),
    (dict(input_activations=None), r"weight-only \(no input_activations\)"),
])
def test_unsupported_compressed_tensors_schemes(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve_quantization(hf_config(ct_quantization_config(**overrides)), None)
    assert "is not INT8 W8A8 with per-channel weights" in str(err.value)


def test_compressed_tensors_extras_are_refused():
    kv = dict(ct_quantization_config(), kv_cache_scheme={"num_bits": 8, "type": "float"})
    with pytest.raises(ValueError, match="KV-cache quantization"):
        resolve_quantization(hf_config(kv), None)
    head = dict(ct_quantization_config(), ignore=[])
    with pytest.raises(ValueError, match="quantizes lm_head"):
        resolve_quantization(hf_config(head), None)


def test_compressed_tensors_targets_and_ignore():
    cfg = ct_quantization_config()
    cfg["ignore"] = ["lm_head", "re:.*down_proj$"]
    cfg["config_groups"]["group_1"] = dict(CT_W8A8_GROUP, targets=["model.layers.0.mlp.up_proj"])
    assert ct_scheme_for("model.layers.1.mlp.down_proj", cfg) is None
    assert ct_scheme_for("model.layers.0.mlp.up_proj", cfg) is cfg["config_groups"]["group_1"]
    assert ct_scheme_for("model.layers.1.mlp.up_proj", cfg) is cfg["config_groups"]["group_0"]


# ---- ModelSlim descriptions ----------------------------------------------------------------------
@pytest.mark.parametrize("entries, message", [
    ({"model.layers.0.mlp.up_proj.weight": "W4A8_DYNAMIC"}, r"\['W4A8_DYNAMIC'\]"),
    ({"kv_cache_type": "C8"}, "KV-cache / attention quantization"),
    ({"model.layers.0.input_layernorm.bias": "FLOAT"}, "RMSNorm biases"),
    ({"lm_head.weight": "W8A8"}, "keeps the embeddings and lm_head in float"),
])
def test_unsupported_modelslim(tmp_path, entries, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(hf_config(folder=modelslim_folder(tmp_path, **entries)), None)


def test_modelslim_layer_types(tmp_path):
    desc = json.loads((modelslim_folder(tmp_path) / "quant_model_description.json").read_text())
    assert modelslim_type_for("model.layers.0.self_attn.qkv_proj", desc) == "W8A8"
    assert modelslim_type_for("model.layers.0.mlp.down_proj", desc) is None
    desc["model.layers.0.self_attn.k_proj.weight"] = "FLOAT"
    with pytest.raises(ValueError, match="quantized differently"):
        modelslim_type_for("model.layers.0.self_attn.qkv_proj", desc)


def test_vision_language_names_are_read_as_the_text_model(tmp_path):
    """Qwen3.5(-MoE) checkpoints nest the text model under model.language_model.: their
    descriptions and ignore lists are read by the text model's names, as the weights load."""
    vlm = "model.language_model.layers.0.mlp."
    entries = {f"{vlm}experts.{e}.{p}_proj.weight": "W8A8_DYNAMIC"
               for e in range(2) for p in ("gate", "up", "down")}
    folder = modelslim_folder(tmp_path, **entries, **{f"{vlm}gate.weight": "FLOAT"})
    _, config = resolve_quantization(hf_config(folder=folder), "ascend")
    desc = config["description"]
    assert schemes.modelslim_expert_type("model.layers.0.mlp.experts", 2, desc) == "W8A8_DYNAMIC"
    ct = {**ct_quantization_config(), "ignore": ["lm_head", "model.language_model.layers.0.mlp.gate"]}
    assert ct_scheme_for("model.layers.0.mlp.gate", ct) is None
    assert ct_scheme_for("model.layers.1.mlp.gate", ct) is not None
