"""The ``vllm serve`` commands of vLLM Ascend's Qwen tutorials, parsed by ``qwenserve serve``.

The corpus (``data/vllm_ascend_qwen_serve_commands.json``) is extracted by
``scripts/extract_vllm_ascend_commands.py`` from github.com/vllm-project/vllm-ascend at the commit
recorded in the file, docs/source/tutorials/models/. Each command must parse, or be refused with
a message that names one of its flags; the refused ones are listed here with the flag, so a flag
that starts being refused (or accepted) shows up as a test failure.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from qwenserve.entrypoints.openai.cli_args import make_serve_parser

CORPUS = json.loads((Path(__file__).parent / "data" / "vllm_ascend_qwen_serve_commands.json")
                    .read_text())
# Values for the shell variables and <placeholders> the tutorials leave to the reader.
PLACEHOLDER_BY_FLAG = {
    "--host": "127.0.0.1", "--port": "8000", "--data-parallel-size": "2",
    "--data-parallel-rank": "0", "--data-parallel-start-rank": "0",
    "--data-parallel-address": "127.0.0.1", "--data-parallel-rpc-port": "13389",
    "--tensor-parallel-size": "2", "--tokenizer": "tokenizer_path",
}


def concrete_argv(command: str) -> list[str]:
    """The command's arguments after ``vllm serve``, with placeholders filled in."""
    argv = shlex.split(command)[2:]
    out: list[str] = []
    for i, arg in enumerate(argv):
        if re.fullmatch(r"\$\{?\w+\}?|<[\w-]+>", arg):
            flag = argv[i - 1].replace("_", "-") if i else ""
            arg = PLACEHOLDER_BY_FLAG.get(flag, "model_path")
        out.append(arg)
    return out


def outcome(command: str) -> str:
    """"ok", or the refusal message argparse printed."""
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            make_serve_parser().parse_args(concrete_argv(command))
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return "ok"


IDS = [f"{c['file'].rsplit('/', 1)[-1]}:{c['line']}" for c in CORPUS["commands"]]


@pytest.mark.parametrize("entry", CORPUS["commands"], ids=IDS)
def test_each_command_parses_or_is_refused_by_flag_name(entry):
    result = outcome(entry["command"])
    if result == "ok":
        return
    named = re.findall(r"--[\w.-]+", result)
    assert named, f"refusal names no flag: {result}"
    assert any(n.split(".")[0] in entry["command"].replace("_", "-") for n in named), result
