"""doctor --model: config, index, shard headers and bounds, tokenizer, permissions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from ops_helpers import by_id, run_doctor
from safetensors.numpy import save_file

from qwenserve.tools.doctor.safetensors_check import inspect_shard

MODEL_CHECKS = (
    "model_permissions",
    "model_config",
    "model_quantization",
    "model_weights",
    "model_shards",
    "model_tokenizer",
)

pytestmark = pytest.mark.usefixtures("clean_env")


def make_model(folder: Path, architecture: str = "Qwen3ForCausalLM") -> Path:
    """A two-shard Qwen3-shaped folder: config, index, shards, tokenizer files."""
    folder.mkdir(parents=True)
    config = {"architectures": [architecture], "model_type": "qwen3", "hidden_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": np.ones((16, 8), dtype=np.float16),
            "model.layers.0.mlp.up_proj.weight": np.ones((32, 8), dtype=np.float16),
        },
        "model-00002-of-00002.safetensors": {
            "model.norm.weight": np.ones(8, dtype=np.float32),
            "lm_head.weight": np.ones((16, 8), dtype=np.float16),
        },
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 1234}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "Qwen3-tiny")


def doctor_model(capsys, folder: Path) -> tuple[int, dict]:
    return run_doctor(capsys, "--platform", "cpu", "--model", str(folder))


def test_sound_model_passes(model, capsys):
    code, report = doctor_model(capsys, model)
    checks = by_id(report)
    assert {c: checks[c]["status"] for c in MODEL_CHECKS} == dict.fromkeys(MODEL_CHECKS, "PASS")
    assert "Qwen3ForCausalLM" in checks["model_config"]["reason"]
    assert "all 2 shards" in checks["model_weights"]["reason"]
    assert code == 0


def test_missing_folder_fails(tmp_path, capsys):
    code, report = doctor_model(capsys, tmp_path / "nope")
    checks = by_id(report)
    assert code == 1 and "does not exist" in checks["model_config"]["reason"]
    assert checks["model_weights"]["status"] == "SKIP"


def test_unsupported_architecture_fails(tmp_path, capsys):
    folder = make_model(tmp_path / "m", architecture="DeepseekV3ForCausalLM")
    code, report = doctor_model(capsys, folder)
    check = by_id(report)["model_config"]
    assert code == 1 and "DeepseekV3ForCausalLM" in check["reason"]
    assert "Qwen3ForCausalLM" in check["fix"]


def test_config_that_does_not_parse_fails(model, capsys):
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],')
    code, report = doctor_model(capsys, model)
    assert code == 1 and "does not parse" in by_id(report)["model_config"]["reason"]


def test_shard_named_in_index_but_missing_fails(model, capsys):
    (model / "model-00002-of-00002.safetensors").unlink()
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_weights"]
    assert code == 1 and "1 of 2 shards" in check["reason"]
    assert "model-00002-of-00002.safetensors" in check["reason"]
    assert "huggingface-cli download <repo-id> model-00002-of-00002.safetensors" in check["fix"]


def test_truncated_shard_fails(model, capsys):
    shard = model / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])  # interrupted download
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_shards"]
    assert code == 1 and "model-00001-of-00002.safetensors is truncated" in check["reason"]


def test_shard_cut_inside_its_header_fails(model, capsys):
    shard = model / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:40])
    _, report = doctor_model(capsys, model)
    assert "the header needs" in by_id(report)["model_shards"]["reason"]


def test_corrupt_header_fails(model, capsys):
    shard = model / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#" * 12  # header JSON overwritten
    shard.write_bytes(bytes(data))
    code, report = doctor_model(capsys, model)
    assert code == 1 and "corrupt header" in by_id(report)["model_shards"]["reason"]


def test_header_whose_offsets_do_not_match_the_shape_is_corrupt(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    assert "corrupt header" in (inspect_shard(path).error or "")


def test_lfs_pointer_instead_of_weights_fails(model, capsys):
    (model / "model-00002-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 3963750880\n"
    )
    _, report = doctor_model(capsys, model)
    assert "Git LFS pointer" in by_id(report)["model_shards"]["reason"]


def test_index_naming_a_tensor_the_shard_lacks_fails(model, capsys):
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    _, report = doctor_model(capsys, model)
    assert "lacks 1 tensor(s)" in by_id(report)["model_shards"]["reason"]


def test_single_file_model_without_index_passes(tmp_path, capsys):
    folder = make_model(tmp_path / "m")
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model-00002-of-00002.safetensors").unlink()
    _, report = doctor_model(capsys, folder)
    checks = by_id(report)
    assert (
        checks["model_weights"]["status"] == "PASS" and checks["model_shards"]["status"] == "PASS"
    )


def test_folder_without_weights_fails(model, capsys):
    for path in model.glob("*.safetensors*"):
        path.unlink()
    _, report = doctor_model(capsys, model)
    assert by_id(report)["model_weights"]["status"] == "FAIL"


def test_missing_tokenizer_fails(model, capsys):
    (model / "tokenizer.json").unlink()
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_tokenizer"]
    assert code == 1 and check["status"] == "FAIL" and "no tokenizer files" in check["reason"]


def test_tokenizer_from_vocab_and_merges_is_accepted(model, capsys):
    (model / "tokenizer.json").unlink()
    (model / "vocab.json").write_text("{}")
    (model / "merges.txt").write_text("#version: 0.2\n")
    _, report = doctor_model(capsys, model)
    assert by_id(report)["model_tokenizer"]["status"] == "PASS"


def test_base_model_without_chat_template_warns(model, capsys):
    (model / "tokenizer_config.json").write_text("{}")
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_tokenizer"]
    assert code == 0 and check["status"] == "WARN" and "--chat-template" in check["fix"]


def test_unreadable_file_fails_mocked(model, capsys, monkeypatch):
    """Root reads everything, so the permission bit is mocked where the check looks at it."""
    secret = str(model / "model-00002-of-00002.safetensors")
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == secret else real_access(p, mode)
    )
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_permissions"]
    assert code == 1 and secret in check["reason"] and "chmod -R a+rX" in check["fix"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read files whatever their mode")
def test_unreadable_file_fails_for_real(model, capsys):
    shard = model / "model-00001-of-00002.safetensors"
    shard.chmod(0o000)
    try:
        code, report = doctor_model(capsys, model)
    finally:
        shard.chmod(0o644)
    assert code == 1 and by_id(report)["model_permissions"]["status"] == "FAIL"


def test_broken_symlink_is_reported(model, capsys):
    # Hugging Face caches link snapshots to blobs; a deleted blob leaves a dangling link.
    (model / "model-00002-of-00002.safetensors").unlink()
    (model / "model-00002-of-00002.safetensors").symlink_to(model / "blobs" / "gone")
    _, report = doctor_model(capsys, model)
    assert by_id(report)["model_permissions"]["status"] == "FAIL"


_W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
             "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                   "symmetric": True, "dynamic": True}}}}  # fmt: skip


@pytest.mark.parametrize(("quantization_config", "status", "reason"), [
    (_W8A8, "PASS", "compressed-tensors INT8 W8A8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "FAIL", "'awq', which qwenserve"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "FAIL", "'fp8', which qwenserve"),
])  # fmt: skip
def test_quantization_the_server_cannot_run_fails(
    model, capsys, quantization_config, status, reason
):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization_config})
    )
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_quantization"]
    assert check["status"] == status and reason in check["reason"]
    assert code == (1 if status == "FAIL" else 0)
    if status == "FAIL":
        assert "--quantization int8" in check["fix"]


def test_int8_moe_experts_pass(model, capsys):
    """A MoE checkpoint with INT8 experts (the router left float) is served, and doctor says so."""
    config = json.loads((model / "config.json").read_text())
    quant = {**_W8A8, "ignore": ["lm_head", "re:.*mlp.gate$"]}
    (model / "config.json").write_text(json.dumps({**config, "num_experts": 8,
                                                   "quantization_config": quant}))
    code, report = doctor_model(capsys, model)
    check = by_id(report)["model_quantization"]
    assert code == 0 and check["status"] == "PASS"
    assert check["reason"] == "compressed-tensors INT8 W8A8, MoE experts INT8 (per-token dynamic " \
        "activations)"
