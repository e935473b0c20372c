"""diagnose recognises qwenserve's own errors as the package raises them today: each case below
triggers the real error (no copied message text), so a reworded message fails here."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from types import SimpleNamespace as NS

import pytest

from qwenserve.tools.diagnose import diagnose_text


def raised(action: Callable[[], object]) -> BaseException:
    try:
        action()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any error is the subject here
        return e
    raise AssertionError("expected an error")


def as_logged(error: BaseException) -> list[str]:
    """The two ways a start-up error reaches the log: the server's one-line report, and the last
    line of a traceback."""
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    return [
        f"ERROR 09-02 10:20:01 [qwenserve.entrypoints.openai.api_server] Cannot start the "
        f"server: {error}",
        f"Traceback (most recent call last):\n  ...\n{name}: {error}",
    ]


def assert_diagnosed(error: BaseException, rule_id: str) -> None:
    for log in as_logged(error):
        verdict = diagnose_text(log)
        assert verdict.rule is not None, f"unrecognised: {error}"
        assert verdict.rule.id == rule_id, (str(error), verdict.rule.id)
        assert "${" not in verdict.explanation + verdict.fix


def _specs(per_token_heads: int = 8):
    from qwenserve.core.cache.spec import PagedKVSpec

    return [PagedKVSpec(tuple(range(4)), per_token_heads, 128, 2)]


def _cache_too_small():
    from qwenserve.core.cache.plan import plan_cache

    return plan_cache(_specs(), 64 << 20, 16, 8, 32768)


def _state_too_small():
    from qwenserve.core.cache.plan import state_slots_for

    return state_slots_for(153_944_064, 100 << 20, 256)


def _max_len_over_model():
    from qwenserve.models.model_config import resolve_max_model_len

    return resolve_max_model_len(65536, NS(max_position_embeddings=32768))


def _tp_heads():
    from qwenserve.engine.mp_executor import check_tp_divides

    cfg = NS(num_attention_heads=28, num_key_value_heads=4)
    return check_tp_divides(NS(parallel=NS(tensor_parallel_size=8), model=NS(hf_config=cfg)))


def _tp_shard():
    from qwenserve.distributed.parallel_group import ParallelGroup

    return ParallelGroup(rank=0, world_size=32).shard(48, "linear_num_value_heads")


def _quant(config: dict | None, flag: str | None):
    from qwenserve.quantization import resolve_quantization

    return lambda: resolve_quantization(NS(quantization_config=config), flag)


_CT = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
       "config_groups": {"g": {"targets": ["Linear"], "weights": {
           "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
           "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                 "symmetric": True, "dynamic": True}}}}  # fmt: skip

CASES: dict[str, tuple[Callable[[], object], str]] = {
    "kv-cache-too-small": (_cache_too_small, "qs-kv-cache-too-small"),
    "state-too-small": (_state_too_small, "qs-recurrent-state-too-small"),
    "max-len-over-model": (_max_len_over_model, "max-model-len-over-derived"),
    "tp-heads": (_tp_heads, "tp-not-divisible"),
    "tp-shard": (_tp_shard, "tp-not-divisible"),
    "awq-checkpoint": (
        _quant({"quant_method": "awq", "bits": 4}, None),
        "qs-quantization-unsupported",
    ),
    "4-bit-compressed-tensors": (
        _quant(
            {
                **_CT,
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}
                },
            },
            None,
        ),
        "qs-quantization-unsupported",
    ),  # fmt: skip
    "w8a8-flag-on-float": (_quant(None, "w8a8"), "qs-quantization-flag-mismatch"),
    "int8-flag-on-w8a8": (_quant(_CT, "int8"), "qs-quantization-flag-mismatch"),
    "architecture": (
        lambda: __import__("qwenserve.models.registry", fromlist=["x"]).resolve_architecture(
            ["LlavaForConditionalGeneration"]
        ),
        "qs-unsupported-architecture",
    ),  # fmt: skip
    "rope-type": (
        lambda: __import__("qwenserve.layers.rotary", fromlist=["x"])._inv_freq(
            NS(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}), 64
        ),
        "qs-model-feature-unsupported",
    ),  # fmt: skip
    "model-path": (
        lambda: __import__("qwenserve.models.source", fromlist=["x"]).resolve_source(
            "/nonexistent/Qwen3-8B"
        ),
        "qs-model-path-missing",
    ),
    "worker-died": (
        lambda: (_ for _ in ()).throw(
            __import__("qwenserve.engine.mp_executor", fromlist=["x"]).WorkerDiedError(
                "Tensor-parallel worker rank 1 (pid 4242) died with exit code 1"
            )
        ),
        "qs-worker-died",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_errors_raised_by_the_package(case):
    action, rule_id = CASES[case]
    assert_diagnosed(raised(action), rule_id)


def test_the_kv_fix_names_the_length_that_fits():
    verdict = diagnose_text(as_logged(raised(_cache_too_small))[0])
    tokens = (64 << 20) // (16 * 2 * 4 * 8 * 128 * 2) * 16
    assert f"Lower --max-model-len to {tokens} or less" in verdict.fix


def test_worker_killed_by_the_os_is_host_memory():
    from qwenserve.engine.mp_executor import WorkerDiedError

    error = WorkerDiedError("Tensor-parallel worker rank 3 (pid 7) died with exit code -9")
    assert_diagnosed(error, "host-oom-killed")


def _write_shard(path, declared_bytes: int, actual_bytes: int) -> None:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [declared_bytes // 4], "data_offsets": [0, declared_bytes]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * actual_bytes)


def test_model_folder_errors(tmp_path):
    from qwenserve.models.loader import safetensors_files
    from qwenserve.models.source import read_config_json, resolve_source

    assert_diagnosed(raised(lambda: safetensors_files(str(tmp_path))), "qs-model-files-invalid")
    assert_diagnosed(raised(lambda: resolve_source(str(tmp_path))), "qs-model-files-invalid")
    (tmp_path / "config.json").write_text("{not json")
    assert_diagnosed(raised(lambda: read_config_json(str(tmp_path))), "qs-model-files-invalid")
    index = {"weight_map": {"w": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_diagnosed(raised(lambda: safetensors_files(str(tmp_path))), "qs-shard-missing")
    (tmp_path / "model.safetensors.index.json").unlink()
    _write_shard(tmp_path / "model.safetensors", 4096, 100)
    assert_diagnosed(raised(lambda: safetensors_files(str(tmp_path))), "qs-safetensors-invalid")


def test_environment_and_flag_errors(monkeypatch, capsys):
    from qwenserve import envs
    from qwenserve.distributed.init import rendezvous
    from qwenserve.entrypoints.openai.cli_args import make_serve_parser
    from qwenserve.platforms import resolve_platform

    monkeypatch.setenv("QWENSERVE_CPU_KVCACHE_SPACE", "lots")
    assert_diagnosed(raised(envs.cpu_kvcache_space_gib), "cpu-kvcache-space-invalid")
    monkeypatch.setenv("QWENSERVE_PLATFORM", "tpu")
    assert_diagnosed(raised(resolve_platform), "qs-invalid-setting")
    monkeypatch.delenv("QWENSERVE_PLATFORM")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert_diagnosed(raised(lambda: rendezvous(3)), "qs-multi-node-env")
    assert_diagnosed(raised(lambda: rendezvous(4)), "qs-multi-node-env")
    for argv, rule_id in (
        (["m", "--kv-cache-dtype", "fp8"], "qs-flag-not-implemented"),
        (["m", "--enable-auto-tool-choice"], "tool-call-parser-missing"),
    ):
        raised(lambda: make_serve_parser().parse_args(argv))  # noqa: B023 - called at once
        stderr = capsys.readouterr().err
        assert diagnose_text(stderr).rule.id == rule_id, stderr


def test_serving_errors(tiny_model):
    from qwenserve import LLM
    from qwenserve.entrypoints.chat_utils import render_chat
    from qwenserve.entrypoints.openai.errors import context_length_error

    llm = LLM(tiny_model("qwen3"), dtype="float32", max_model_len=64)
    assert_diagnosed(raised(lambda: llm.llm_engine.check_prompt([1] * 100)), "prompt-too-long")
    assert_diagnosed(context_length_error(64, 60, 10), "qs-context-length-exceeded")
    no_template = NS(chat_template=None)
    assert_diagnosed(raised(lambda: render_chat(no_template, [{"role": "user", "content": "hi"}])),
                     "chat-template-missing")  # fmt: skip


def test_engine_config_errors(tiny_model, tmp_path):
    from qwenserve.engine.arg_utils import EngineArgs
    from qwenserve.models.tokenizer import load_tokenizer

    path = tiny_model("qwen2")
    bad = EngineArgs(model=path, gpu_memory_utilization=1.5)
    assert_diagnosed(raised(bad.create_engine_config), "qs-invalid-setting")
    config = EngineArgs(model=path, tokenizer=str(tmp_path)).create_engine_config()
    assert_diagnosed(raised(lambda: load_tokenizer(config.model)), "qs-tokenizer-missing")
