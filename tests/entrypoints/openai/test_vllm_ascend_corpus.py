"""The ``vllm serve`` commands of vLLM Ascend's Qwen tutorials, parsed by ``qwenserve serve``.

The corpus (``data/vllm_ascend_qwen_serve_commands.json``) is extracted by
``scripts/extract_vllm_ascend_commands.py`` from github.com/vllm-project/vllm-ascend at the commit
recorded in the file, docs/source/tutorials/models/. Each command must parse, or be refused with
a message that names one of its flags. All 66 parse (speculative decoding included, with DP x EP
too, and several API server processes); flags qwenserve would refuse by name are listed below
(none today). A new refusal fails the test.
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
    "--data-parallel-rank": "0", "--data-parallel-start-rank": "1",  # a --headless node's
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


# flags whose support was other work; the commands are checked without them too
# (--speculative-config: its MTP and eagle3 methods all parse now, with DP x EP too; kept as
# the seam)
OTHER_WORK = ("--speculative-config",)
# refused by qwenserve, by name (none left: --api-server-count > 1 runs since issue 17's end)
NOT_IMPLEMENTED: tuple[str, ...] = ()


def without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=")[0].replace("_", "-").startswith(flags):
            skip = "=" not in arg  # drop its value too
        else:
            out.append(arg)
    return out


def parse_outcome(argv: list[str]) -> str:
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            make_serve_parser().parse_args(argv)
    except SystemExit:
        return re.findall(r"--[\w.-]+", err.getvalue().strip().splitlines()[-1])[0]
    return "ok"


def test_every_command_parses_but_for_named_gaps():
    """The corpus's tally: each command parses, or its first refused flag is a known gap."""
    raw = [parse_outcome(concrete_argv(c["command"])) for c in CORPUS["commands"]]
    assert set(raw) <= {"ok", *NOT_IMPLEMENTED}, set(raw)
    assert raw.count("ok") == 66, raw.count("ok")
    for c, result in zip(CORPUS["commands"], raw):
        # qwen3_5_mtp and eagle3 parse, with DP x EP too (or a later flag is refused)
        if "mtp" in c["command"] or '"eagle3"' in c["command"]:
            assert result in ("ok", *NOT_IMPLEMENTED), (c["line"], result)
    mtp_dp_ep = [r for c, r in zip(CORPUS["commands"], raw)
                 if "mtp" in c["command"] and "--enable-expert-parallel" in c["command"]
                 and re.search(r"--data-parallel-size '?([2-9]|\$)", c["command"])]
    assert mtp_dp_ep.count("ok") >= 3, mtp_dp_ep
    assert sum('"eagle3"' in c["command"] and r == "ok"
               for c, r in zip(CORPUS["commands"], raw)) == 11
    ours = [parse_outcome(without(concrete_argv(c["command"]), OTHER_WORK))
            for c in CORPUS["commands"]]
    assert set(ours) <= {"ok", *NOT_IMPLEMENTED}, set(ours)
    assert len(CORPUS["commands"]) == 66 and ours.count("ok") == 66, ours.count("ok")


def test_data_parallel_with_expert_parallel_parses_on_every_layout():
    """The commands that combine --data-parallel-size > 1 with --enable-expert-parallel
    (one node, head and --headless nodes, --data-parallel-rank servers, two API servers) parse."""
    combined = []
    for entry in CORPUS["commands"]:
        argv = without(concrete_argv(entry["command"]), OTHER_WORK)
        dp = argv[argv.index("--data-parallel-size") + 1] if "--data-parallel-size" in argv \
            else "1"
        if dp != "1" and "--enable-expert-parallel" in argv:
            combined.append(parse_outcome(argv))
    assert len(combined) >= 12 and combined == ["ok"] * len(combined), combined


IDS = [f"{c['file'].rsplit('/', 1)[-1]}:{c['line']}" for c in CORPUS["commands"]]


@pytest.mark.parametrize("entry", CORPUS["commands"], ids=IDS)
def test_each_command_parses_or_is_refused_by_flag_name(entry):
    result = outcome(entry["command"])
    if result == "ok":
        return
    named = re.findall(r"--[\w.-]+", result)
    assert named, f"refusal names no flag: {result}"
    assert any(n.split(".")[0] in entry["command"].replace("_", "-") for n in named), result
