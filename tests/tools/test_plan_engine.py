"""`qwenserve plan` against the engine: the plan's own `qwenserve serve` command is parsed by the
real serve parser and started, and the figures the engine logs at start-up equal the plan's."""

from __future__ import annotations

import json
import logging
import re
import shlex

import pytest

from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.cli import main
from qwenserve.entrypoints.openai.api_server import build_engine_args
from qwenserve.entrypoints.openai.cli_args import make_serve_parser

_KV_LINE = re.compile(
    r"KV cache: (?P<per_token>[\d,]+) bytes/token, (?P<blocks>\d+) blocks of (?P<bs>\d+) tokens "
    r"= (?P<tokens>[\d,]+) tokens .*?maximum concurrency for (?P<len>[\d,]+) tokens per request: "
    r"(?P<conc>[\d.]+)x(?:; recurrent state: (?P<state>[\d,]+) bytes/sequence x "
    r"(?P<slots>\d+) slots)?"
)


def _int(text: str | None) -> int:
    return int((text or "0").replace(",", ""))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def startup_log():
    """qwenserve's logger does not propagate to the root, so collect its records directly."""
    logger, handler = logging.getLogger("qwenserve"), _Records()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def plan(capsys, *argv: str) -> dict:
    main(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("arch", "quantization"), [
    ("qwen3", None), ("qwen2", "int8"),  # untied and tied embeddings
    ("qwen3_moe", None), ("qwen3_moe", "int8"),  # int8 keeps the experts in float
    ("qwen3_5", None), ("qwen3_5_moe", "int8"),  # DeltaNet state slots beside the KV blocks
])  # fmt: skip
def test_plan_command_starts_an_engine_that_logs_the_planned_figures(
    tiny_model, capsys, startup_log, arch, quantization
):
    path = tiny_model(arch)
    argv = [path, "--device", "cpu", "--dtype", "float32", "--tp", "1", "--max-model-len", "256",
            "--max-num-seqs", "6", "--kv-cache-memory-bytes", "3000000"]  # fmt: skip
    report = plan(capsys, *argv, *(["--quantization", quantization] if quantization else []))
    planned = report["plans"][0]
    command = shlex.split(report["commands"]["qwenserve"])
    assert command[:3] == ["qwenserve", "serve", path]
    engine = LLMEngine.from_engine_args(build_engine_args(make_serve_parser().parse_args(
        command[2:])))  # fmt: skip
    logged = next(m for m in map(_KV_LINE.search, startup_log) if m)
    assert _int(logged["per_token"]) == planned["kv_bytes_per_token"]
    assert _int(logged["blocks"]) == planned["num_blocks"]
    assert _int(logged["bs"]) == report["block_size"]
    assert _int(logged["tokens"]) == planned["kv_token_capacity"]
    assert _int(logged["len"]) == report["max_model_len"] == 256
    assert float(logged["conc"]) == pytest.approx(planned["max_concurrency"], abs=0.006)
    assert _int(logged["state"]) == planned["state_bytes_per_sequence"]
    assert _int(logged["slots"]) == planned["num_state_slots"]
    assert (planned["state_bytes_per_sequence"] > 0) == arch.startswith("qwen3_5")
    # the log rounds weights to 0.01 GiB, so compare with the exact figure behind it
    assert any(f"{planned['weight_bytes_per_device'] / 2**30:.2f} GiB of weights" in m
               for m in startup_log)  # fmt: skip
    assert engine.executor.weight_bytes() == planned["weight_bytes_per_device"]
    # planned at serve's CPU step size, stated for vLLM (whose CPU default is 2048) too
    assert engine.config.scheduler.max_num_batched_tokens == 1024
    for command in filter(None, report["commands"].values()):  # vLLM's: None for int8 here
        assert "--max-num-batched-tokens 1024" in command


def test_a_plan_that_cannot_hold_one_sequence_is_refused_by_the_engine_too(tiny_model, capsys):
    path = tiny_model("qwen3")
    report = plan(capsys, path, "--device", "cpu", "--dtype", "float32", "--tp", "1",
                  "--max-model-len", "1024", "--kv-cache-memory-bytes", "40000")  # fmt: skip
    assert not report["fits"] and "--max-model-len" in report["explanation"]
    largest = report["plans"][0]["largest_max_model_len"]
    assert 0 < largest < 1024 and f"to {largest}" in report["explanation"]
    from qwenserve import LLM
    from qwenserve.core.cache.plan import CacheTooSmallError

    with pytest.raises(CacheTooSmallError, match=f"at most {largest:,} fits"):
        LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=40000)
    LLM(path, dtype="float32", max_model_len=largest, kv_cache_memory_bytes=40000)
