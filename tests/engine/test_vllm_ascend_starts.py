"""A few of vLLM Ascend's tutorial commands (the corpus in tests/entrypoints/openai/data) start
the engine on CPU with tiny random models of their architecture and generate.

Shrunk as the tiny models require, and only that: the model path, ``--tensor-parallel-size``
capped at 2, ``--max-model-len`` capped at the tiny model's 1024 positions (unless YaRN extends
it), a KV budget for this machine, and ``--quantization ascend`` dropped (the tiny checkpoints
are float; a ModelSlim W8A8 checkpoint is what that flag expects). Every other flag is parsed by
the serve parser and reaches ``EngineArgs`` as written. The pooling commands start a real server
in tests/entrypoints/openai/test_server_pooling.py.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.entrypoints.openai.cli_args import make_serve_parser

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")
CORPUS = json.loads((Path(__file__).parents[1] / "entrypoints" / "openai" / "data"
                     / "vllm_ascend_qwen_serve_commands.json").read_text())
DOC = "docs/source/tutorials/models/"


def command(file: str, line: int) -> list[str]:
    entry = next(c for c in CORPUS["commands"] if c["file"] == DOC + file and c["line"] == line)
    argv = shlex.split(entry["command"])[3:]  # after "vllm serve MODEL"
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--host", "--port", "--quantization"):
            skip = True
        else:
            out.append(arg)
    return out


def engine_args(path: str, argv: list[str]) -> EngineArgs:
    ns = make_serve_parser().parse_args([path, *argv])
    args = EngineArgs.from_cli_args(ns)
    args.model = path
    args.tensor_parallel_size = min(args.tensor_parallel_size, 2)
    args.kv_cache_memory_bytes = 160 << 20
    args.dtype = "float32"
    return args


def generates(args: EngineArgs) -> None:
    llm = LLM(**vars(args))
    out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.shutdown()


def test_qwen3_moe_with_expert_parallel_and_yarn(tiny_model):
    """Qwen3-235B-A22B.md: EP at TP=2, YaRN through --hf-overrides (131072 = 32768 x 4)."""
    args = engine_args(tiny_model("qwen3_moe"), command("Qwen3-235B-A22B.md", 214))
    assert args.enable_expert_parallel and args.max_model_len == 131072
    assert args.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    generates(args)


def test_qwen3_next(tiny_model):
    args = engine_args(tiny_model("qwen3_next"), command("Qwen3-Next.md", 133))
    args.max_model_len = 1024
    generates(args)


def test_qwen3_5_dense_with_mtp(tiny_model):
    """Qwen3.5-Dense.md: the checkpoint's MTP head ("qwen3_5_mtp", 1 token) at TP=1, fp16
    DeltaNet state, eager drafter flags as written."""
    from helpers.tiny_models import add_mtp_head

    path = add_mtp_head(tiny_model("qwen3_5", mtp_num_hidden_layers=1))
    args = engine_args(path, command("Qwen3.5-Dense.md", 188))
    assert '"qwen3_5_mtp"' in str(args.speculative_config).replace("'", '"')
    args.max_model_len = 1024
    generates(args)


def test_qwen3_5_mtp_at_tensor_parallel_2(tiny_model):
    """Qwen3.5-27B-Qwen3.6-27B.md: the MTP head (3 tokens, eager drafter) at TP=2, as written."""
    from helpers.tiny_models import add_mtp_head

    path = add_mtp_head(tiny_model("qwen3_5", mtp_num_hidden_layers=1))
    args = engine_args(path, command("Qwen3.5-27B-Qwen3.6-27B.md", 251))
    assert args.tensor_parallel_size == 2 and "qwen3_5_mtp" in str(args.speculative_config)
    args.max_model_len = 1024
    generates(args)


def test_qwen3_eagle3_at_tensor_parallel(tiny_model, tmp_path):
    """Qwen3-Dense.md: an EAGLE-3 head at TP=4 (capped at 2 here); the head's folder is the
    tutorial's placeholder, replaced by a tiny head."""
    from helpers.tiny_models import make_eagle3_head

    target = tiny_model("qwen3", num_hidden_layers=4)
    args = engine_args(target, command("Qwen3-Dense.md", 556))
    assert args.tensor_parallel_size == 2
    spec = json.loads(args.speculative_config) if isinstance(args.speculative_config, str) \
        else dict(args.speculative_config)
    assert spec["method"] == "eagle3" and spec["model"] == "your_eagle3_model_path"
    spec["model"] = make_eagle3_head(target, str(tmp_path / "head"))
    args.speculative_config = spec
    args.max_model_len = 1024
    generates(args)
