"""``doctor --model DIR``: will this folder load? Config, shards, tokenizer and permissions.

The checks read only headers, so a 60-shard model is checked in well under a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from qwenserve.models.registry import SUPPORTED_ARCHITECTURES, is_supported
from qwenserve.tools.doctor.context import DoctorContext
from qwenserve.tools.doctor.result import Check, fail, passed, skip, warn
from qwenserve.tools.doctor.safetensors_check import inspect_shard

INDEX_NAME = "model.safetensors.index.json"
_TOKENIZER_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _redownload(model_dir: Path, name: str = "") -> str:
    target = f" {name}" if name else ""
    return f"download it again: huggingface-cli download <repo-id>{target} --local-dir {model_dir}"


def read_index(model_dir: Path) -> dict[str, str] | None:
    """tensor name -> shard file from the index, or None when the model has no index."""
    path = model_dir / INDEX_NAME
    if not path.is_file():
        return None
    return dict(json.loads(path.read_text())["weight_map"])


def shard_paths(model_dir: Path) -> list[Path]:
    index = read_index(model_dir)
    if index is not None:
        return [model_dir / name for name in sorted(set(index.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def weights_bytes(model_dir: Path | None) -> int:
    if model_dir is None or not model_dir.is_dir():
        return 0
    try:
        return sum(p.stat().st_size for p in shard_paths(model_dir) if p.is_file())
    except (OSError, ValueError, KeyError):
        return 0


def check_model_config(ctx: DoctorContext) -> Check:
    model_dir = ctx.model_dir
    assert model_dir is not None
    if not model_dir.is_dir():
        return fail(
            "model_config",
            f"Model path {model_dir} does not exist or is not a folder",
            f"download it: huggingface-cli download <repo-id> --local-dir {model_dir}",
        )
    path = model_dir / "config.json"
    if not path.is_file():
        return fail("model_config", f"{path} is missing", _redownload(model_dir, "config.json"))
    try:
        config = json.loads(path.read_text())
        architectures = list(config.get("architectures") or [])
    except (OSError, ValueError, AttributeError, TypeError) as e:
        return fail(
            "model_config", f"{path} does not parse: {e}", _redownload(model_dir, "config.json")
        )
    if not any(is_supported(a) for a in architectures):
        return fail(
            "model_config",
            f"architectures {architectures or '(none)'} are not supported by qwenserve",
            f"use a model with one of: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    model_type = config.get("model_type", "?")
    return passed("model_config", f"{architectures[0]} (model_type {model_type})")


def check_model_quantization(ctx: DoctorContext) -> Check:
    """Whether serve can run the checkpoint's quantization, decided by the engine's own rules
    (``quantization.schemes``: INT8 W8A8 only), before any weight is read."""
    model_dir = ctx.model_dir
    try:
        raw = json.loads((model_dir / "config.json").read_text()) if model_dir else None
    except (OSError, ValueError):
        raw = None
    if not isinstance(raw, dict):
        return skip("model_quantization", "no readable config.json")
    from qwenserve.quantization.schemes import detect, experts_quantized

    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    config = SimpleNamespace(
        quantization_config=raw.get("quantization_config", text.get("quantization_config")),
        _name_or_path=str(model_dir),
        num_experts=text.get("num_experts", 0),
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
    )
    try:
        method, quant_config = detect(config)
    except (ValueError, OSError) as e:
        return fail(
            "model_quantization",
            str(e),
            "serve the float checkpoint with --quantization int8, an INT8 W8A8 export, or use "
            "vLLM for this one (`qwenserve plan MODEL` shows the commands)",
        )
    found = {
        None: "float weights (--quantization int8 quantizes them while loading)",
        "compressed-tensors": "compressed-tensors INT8 W8A8",
        "ascend": "ModelSlim W8A8",
    }
    reason = found.get(method, str(method))
    if config.num_experts and experts_quantized(method, quant_config):
        reason += ", MoE experts INT8 (per-token dynamic activations)"
    return passed("model_quantization", reason)


def check_model_index(ctx: DoctorContext) -> Check:
    model_dir = ctx.model_dir
    if model_dir is None or not model_dir.is_dir():
        return skip("model_weights", "no model folder")
    try:
        index = read_index(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return fail(
            "model_weights", f"{INDEX_NAME} does not parse: {e}", _redownload(model_dir, INDEX_NAME)
        )
    if index is None:
        files = sorted(model_dir.glob("*.safetensors"))
        if files:
            return passed("model_weights", f"{len(files)} safetensors file(s), no index")
        return fail(
            "model_weights", f"no *.safetensors weights in {model_dir}", _redownload(model_dir)
        )
    names = sorted(set(index.values()))
    missing = [name for name in names if not (model_dir / name).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        return fail(
            "model_weights",
            f"{len(missing)} of {len(names)} shards named in {INDEX_NAME} are missing: {shown}",
            _redownload(model_dir, missing[0]),
        )
    return passed("model_weights", f"all {len(names)} shards named in {INDEX_NAME} exist")


def check_model_shards(ctx: DoctorContext) -> Check:
    model_dir = ctx.model_dir
    if model_dir is None or not model_dir.is_dir():
        return skip("model_shards", "no model folder")
    try:
        index = read_index(model_dir) or {}
    except (OSError, ValueError, KeyError, TypeError):
        index = {}
    shards = [p for p in shard_paths(model_dir) if p.is_file()]
    if not shards:
        return skip("model_shards", "no shard to inspect")
    for shard in shards:
        problem = _shard_problem(shard, index)
        if problem:
            return fail("model_shards", problem, _redownload(model_dir, shard.name))
    total = sum(p.stat().st_size for p in shards)
    return passed(
        "model_shards", f"{len(shards)} shard headers parse; {total / 2**30:.2f} GiB in bounds"
    )


def _shard_problem(shard: Path, index: dict[str, str]) -> str | None:
    try:
        report = inspect_shard(shard)
    except OSError as e:
        return f"{shard.name} cannot be read: {e.strerror or e}"
    if report.error:
        return f"{shard.name} {report.error}"
    expected = [name for name, file in index.items() if file == shard.name]
    absent = [name for name in expected if name not in report.tensor_names]
    if absent:
        return f"{shard.name} lacks {len(absent)} tensor(s) the index puts there, e.g. {absent[0]}"
    return None


def check_model_tokenizer(ctx: DoctorContext) -> Check:
    model_dir = ctx.model_dir
    if model_dir is None or not model_dir.is_dir():
        return skip("model_tokenizer", "no model folder")
    present = {p.name for p in model_dir.iterdir()}
    if not any(all(name in present for name in group) for group in _TOKENIZER_SETS):
        return fail(
            "model_tokenizer",
            "no tokenizer files (tokenizer.json, or vocab.json + merges.txt)",
            _redownload(model_dir, "tokenizer.json") + " or pass --tokenizer",
        )
    if "tokenizer_config.json" not in present:
        return warn(
            "model_tokenizer",
            "tokenizer_config.json is missing (special tokens, chat template)",
            _redownload(model_dir, "tokenizer_config.json"),
        )
    if not _has_chat_template(model_dir, present):
        return warn(
            "model_tokenizer",
            "no chat template: /v1/chat/completions will fail",
            "pass --chat-template FILE, or use /v1/completions for a base model",
        )
    return passed("model_tokenizer", "tokenizer files and chat template present")


def _has_chat_template(model_dir: Path, present: set[str]) -> bool:
    if any(name in present for name in _CHAT_TEMPLATE_FILES):
        return True
    try:
        return bool(
            json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
        )
    except (OSError, ValueError, AttributeError):
        return False


def check_model_permissions(ctx: DoctorContext) -> Check:
    model_dir = ctx.model_dir
    if model_dir is None or not model_dir.exists():
        return skip("model_permissions", "no model folder")
    unreadable: list[str] = []
    for root, dirs, files in os.walk(model_dir):
        for name in dirs:
            if not os.access(os.path.join(root, name), os.R_OK | os.X_OK):
                unreadable.append(os.path.join(root, name) + "/")
        unreadable += [
            os.path.join(root, n) for n in files if not os.access(os.path.join(root, n), os.R_OK)
        ]
    if not os.access(model_dir, os.R_OK | os.X_OK):
        unreadable.insert(0, f"{model_dir}/")
    if unreadable:
        shown = ", ".join(unreadable[:3]) + (
            f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        )
        return fail(
            "model_permissions",
            f"the current user cannot read {shown} (or a link is broken)",
            f"chmod -R a+rX {model_dir}, or run the server as the files' owner",
        )
    return passed("model_permissions", "every file is readable by the current user")
