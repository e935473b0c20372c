"""The ``qwenserve serve`` and ``vllm serve`` lines for a plan, and what each cannot do.

A command is only printed when that server can run the plan as computed; otherwise it is None and
a note says why (qwenserve runs INT8 W8A8 only and keeps the KV cache in the model dtype; vLLM has
no load-time INT8 of a float checkpoint), so a command never promises a capacity it cannot reach.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, field

from qwenserve.options.compilation import DECODE_REPLAY_BYTES
from qwenserve.tools.plan.quant import QuantChoice

# both servers' `serve` step size on accelerators (vLLM's, and on Ascend); CPUs: plan/cli.py
DEFAULT_BATCHED_TOKENS = 2048


@dataclass
class Commands:
    qwenserve: str | None
    vllm: str | None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CommandInputs:
    args: argparse.Namespace
    tp: int
    max_model_len: int
    dtype: str
    device_kind: str
    quant: str | None  # the width planned with
    checkpoint: QuantChoice
    qwenserve_problem: str | None


def build_commands(c: CommandInputs) -> Commands:
    a = c.args
    flags = [
        "--tensor-parallel-size",
        str(c.tp),
        "--max-model-len",
        str(c.max_model_len),
        "--dtype",
        c.dtype,
        "--max-num-seqs",
        str(a.max_num_seqs),
    ]
    if getattr(a, "enable_expert_parallel", False):
        flags += ["--enable-expert-parallel"]
    if getattr(a, "mamba_ssm_cache_dtype", "auto") != "auto":
        flags += ["--mamba-ssm-cache-dtype", a.mamba_ssm_cache_dtype]
    if getattr(a, "hf_overrides", None):
        flags += ["--hf-overrides", json.dumps(a.hf_overrides)]
    # on CPU the two servers' defaults differ (qwenserve 1024, vLLM 2048): state the planned one
    if a.max_num_batched_tokens != DEFAULT_BATCHED_TOKENS or c.device_kind == "cpu":
        flags += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.block_size:
        flags += ["--block-size", str(a.block_size)]
    if getattr(a, "speculative_config", None):
        flags += ["--speculative-config", a.speculative_config]
    if a.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(a.kv_cache_memory_bytes)]
    elif c.device_kind != "cpu":
        flags += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    out = Commands(None, None)
    _qwenserve(c, list(flags), out)
    _vllm(c, list(flags), out)
    if c.device_kind == "cpu" and out.qwenserve is not None:
        out.notes.append(
            f"on CPU qwenserve replays recorded decode steps of dense models; their buffers take "
            f"up to {DECODE_REPLAY_BYTES >> 20} MiB of RAM beside the weights, the KV cache and "
            "the activations (--enforce-eager: none)")
    if a.quantization in _CHECKPOINT_FORMATS and c.checkpoint.width is None:
        out.notes.append(
            f"{a.quantization} is planned for {_CHECKPOINT_FORMATS[a.quantization]}"
            f" checkpoint of {a.model}: serve that folder instead"
            + (
                "; --quantization int8 quantizes this float one while loading (embeddings too)"
                if a.quantization == "w8a8"
                else ""
            )
        )
    return out


_CHECKPOINT_FORMATS = {
    "w8a8": "an INT8 W8A8 (ModelSlim or llm-compressor)",
    "awq": "an AWQ",
    "gptq": "a GPTQ",
    "w4a16": "a compressed-tensors 4-bit",
}


def _line(program: str, model: str, flags: list[str]) -> str:
    return f"{program} serve {shlex.quote(model)} " + shlex.join(flags)


def _qwenserve(c: CommandInputs, flags: list[str], out: Commands) -> None:
    if c.qwenserve_problem:
        out.notes.append(f"no qwenserve command: {c.qwenserve_problem}")
        return
    if c.args.kv_cache_dtype != "auto":
        out.notes.append(
            "no qwenserve command: qwenserve keeps the KV cache in the model dtype "
            "(--kv-cache-dtype is vLLM's only); plan without it for qwenserve"
        )
        return
    if c.args.quantization == "int8":
        flags += ["--quantization", "int8"]
    out.qwenserve = _line("qwenserve", c.args.model, flags)


def _vllm(c: CommandInputs, flags: list[str], out: Commands) -> None:
    requested = c.args.quantization
    if requested == "int8":
        out.notes.append(
            "no vllm command: vLLM has no load-time INT8 of a float checkpoint; "
            "quantize it to W8A8 (ModelSlim on Ascend, llm-compressor elsewhere) "
            "and plan w8a8"
        )
        return
    npu = c.device_kind == "npu"
    if npu and c.quant in ("awq", "gptq", "w4a16"):
        out.notes.append(f"no vllm command: vLLM Ascend does not run {c.quant} weights")
        return
    if c.checkpoint.modelslim and not npu:
        out.notes.append("no vllm command: ModelSlim checkpoints run on vLLM Ascend only")
        return
    if c.checkpoint.modelslim or (npu and requested == "w8a8"):
        flags += ["--quantization", "ascend"]  # ModelSlim W8A8 (vLLM Ascend's name)
    elif requested in ("fp8", "awq", "gptq") and not c.checkpoint.from_checkpoint:
        flags += ["--quantization", requested]  # fp8 quantizes at load; awq/gptq need such weights
    if c.args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", c.args.kv_cache_dtype]
    out.vllm = _line("vllm", c.args.model, flags)
