"""``qwenserve serve`` flags: vLLM's names, groups and defaults; refusals that say why; --config;
start-up failures as one line and exit code 1; ``qwenserve chat``."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from qwenserve.entrypoints.cli import main as cli_main
from qwenserve.entrypoints.openai.cli_args import make_serve_parser

ISSUE_FLAGS = [
    "--host",
    "--port",
    "--served-model-name",
    "--api-key",
    "--dtype",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--tensor-parallel-size",
    "--quantization",
    "--seed",
    "--enforce-eager",
    "--chat-template",
    "--generation-config",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "--reasoning-parser",
    "--disable-log-requests",
    "--uvicorn-log-level",
    "--trust-remote-code",
    "--config",
]


def parse(argv: list[str]):
    return make_serve_parser().parse_args(argv)


def cli_main_parse(argv: list[str]):
    """Parse as ``qwenserve serve ...`` does (the serve parser is a subparser there)."""
    from qwenserve.entrypoints.cli import build_parser

    return build_parser("serve").parse_args(argv)


def test_every_flag_of_the_issue_with_vllm_defaults():
    parser = make_serve_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    assert not [f for f in ISSUE_FLAGS if f not in known]
    ns = parse(["Qwen/Qwen3-0.6B"])
    assert ns.model_tag == "Qwen/Qwen3-0.6B" and ns.port == 8000 and ns.host is None
    assert ns.dtype == "auto" and ns.gpu_memory_utilization == 0.9 and ns.seed == 0
    assert ns.enable_prefix_caching is True and ns.uvicorn_log_level == "info"
    assert ns.tensor_parallel_size == 1 and ns.api_key is None
    ns = parse(
        [
            "m",
            "--max-model-len",
            "32k",
            "--kv-cache-memory-bytes",
            "4G",
            "-tp",
            "1",
            "--served-model-name",
            "a",
            "b",
            "--no-enable-prefix-caching",
        ]
    )
    assert ns.max_model_len == 32000 and ns.kv_cache_memory_bytes == 4 << 30
    assert ns.served_model_name == ["a", "b"] and ns.enable_prefix_caching is False


def test_help_groups_like_vllm(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for group in (
        "Frontend",
        "ModelConfig",
        "CacheConfig",
        "SchedulerConfig",
        "ParallelConfig",
        "LoadConfig",
    ):
        assert f"\n{group}:" in out, group
    with pytest.raises(SystemExit):
        parse(["--help=listgroup"])
    assert "Frontend" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse(["--help=max-num-seqs"])
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "--port" not in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not implemented yet"),
        (["-pp", "2"], "--pipeline-parallel-size 2 is not implemented yet"),
        (["--distributed-executor-backend", "ray"], "not implemented yet"),
        (["--no-enable-chunked-prefill"], "--enable-chunked-prefill False is not implemented yet"),
        (["--lora-modules", "a=b"], "--lora-modules a=b is not implemented yet"),
        (["--tool-call-parser", "mistral"], "mistral is not implemented yet"),
        (["--structured-outputs-config", '{"backend": "guidance"}'],
         "backend 'guidance' is not implemented in qwenserve"),
        (["--structured-outputs-config.backend", "outlines"], "'outlines' is not implemented"),
        (["--structured-outputs-config.nonsense=1"], "unknown key(s) ['nonsense']"),
        (["--structured-outputs-config.disable_any_whitespace", "maybe"], "must be true or false"),
        (["--reasoning-parser", "granite"], "granite is not implemented yet"),
        (["--reasoning-parser", "nonsense"], "nonsense is unknown"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--max-loras", "4"], "--max-loras is not implemented yet in qwenserve"),
        (["--rope-theta=1e6"], "--rope-theta is not implemented yet in qwenserve"),
        (["--disable-custom-all-reduce"], "--disable-custom-all-reduce is not implemented yet"),
        (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
         'method eagle3 needs "model"'),
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
         "method 'eagle': EAGLE heads are not implemented"),
        (["--speculative-config.method", "ngram"], "num_speculative_tokens >= 1"),
    ],
)
def test_refused_flags_say_why(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        parse(["model", *argv])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_structured_outputs_config_as_json_or_dotted():
    from qwenserve.structured_output.config import parse_structured_outputs_config

    for argv in (
        ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
        ["--structured-outputs-config.backend", "xgrammar",
         "--structured-outputs-config.disable_any_whitespace=true"],
        ["--structured-outputs-config", '{"backend": "xgrammar"}',
         "--structured-outputs-config.disable-any-whitespace", "true"],
    ):
        config = parse_structured_outputs_config(parse(["model", *argv]).structured_outputs_config)
        assert config.backend == "xgrammar" and config.disable_any_whitespace
    assert parse(["model", "--tool-call-parser", "qwen3_xml"]).tool_call_parser == "qwen3_xml"


def test_speculative_config_as_json_or_dotted():
    from qwenserve.spec_decode.config import parse_speculative_config

    for argv in (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens=3"],
    ):
        config = parse_speculative_config(parse(["model", *argv]).speculative_config)
        assert (config.method, config.num_speculative_tokens) == ("ngram", 3)


def test_help_all_and_a_keyword_without_match(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--help=all"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--max-num-seqs" in out and "--port" in out
    assert "--help=listgroup" in out  # the epilog, as vLLM's
    with pytest.raises(SystemExit):
        parse(["--help=lora"])
    out = capsys.readouterr().out
    assert "No group or parameter matching 'lora'" in out and "--max-loras" in out
    assert "not implemented yet" in out


def test_flags_vllm_ignores_or_defaults_are_accepted():
    ns = parse(
        [
            "m",
            "--swap-space",
            "4",
            "--kv-cache-dtype",
            "auto",
            "-pp",
            "1",
            "--distributed-executor-backend",
            "mp",
            "--enable-chunked-prefill",
            "--enforce-eager",
            "--trust-remote-code",
            "--enable-reasoning",
            "--disable-log-requests",
            "--reasoning-parser",
            "qwen3",
        ]
    )
    assert ns.swap_space == 4 and ns.enforce_eager and ns.trust_remote_code


def test_config_yaml_and_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/qwen\nport: 9000\nserved_model_name: [a, b]\n"
        "enable-prefix-caching: false\nmax-model-len: 4k\n"
        "default-chat-template-kwargs: {enable_thinking: false}\n"
    )
    ns = parse(["--config", str(config), "--port", "9100"])
    assert ns.model == "/models/qwen" and ns.port == 9100 and ns.served_model_name == ["a", "b"]
    assert ns.enable_prefix_caching is False and ns.max_model_len == 4000
    assert ns.default_chat_template_kwargs == {"enable_thinking": False}
    # A model on the command line wins over the YAML's, as in vLLM (no "given twice" clash).
    ns = parse(["/models/other", "--config", str(config)])
    assert ns.model_tag == "/models/other" and ns.model is None and ns.port == 9000
    ns = parse(["--model", "/models/third", "--config", str(config)])
    assert ns.model == "/models/third"
    # A list-valued flag last in the file must not swallow the command line's model.
    listed = tmp_path / "listed.yaml"
    listed.write_text("model: /models/qwen\napi-key: [k1, k2]\n")
    ns = cli_main_parse(["serve", "/models/cli", "--config", str(listed)])
    assert ns.model_tag == "/models/cli" and ns.api_key == ["k1", "k2"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("not_a_flag: 1\n")
    with pytest.raises(SystemExit):
        parse(["--config", str(bad)])


def test_startup_failure_is_one_line_and_exit_1(tiny_model_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qwenserve.entrypoints.cli",
            "serve",
            tiny_model_path,
            "--quantization",
            "compressed-tensors",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "quantization" in errors[0], proc.stderr


def test_chat_repl_streams_replies(tiny_model_path):
    from qwenserve.entrypoints import chat

    parser = make_chat_parser()
    args = parser.parse_args(
        [
            tiny_model_path,
            "--dtype",
            "float32",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--kv-cache-memory-bytes",
            "16M",
        ]
    )
    out = io.StringIO()
    code = chat.run(args, stdin=io.StringIO("Hello\n/reset\nHi again\n/exit\n"), stdout=out)
    text = out.getvalue()
    assert code == 0 and "\n(conversation cleared)\n" in text
    assert text.index("(conversation cleared)") > 0 and not text.endswith("cleared)\n")


def make_chat_parser():
    import argparse

    from qwenserve.entrypoints import chat

    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    return parser


def test_serve_parser_is_a_subclass_without_an_import_circle():
    """Issue 14: no rebinding of ``parse_known_args``, and cli_args does not import api_server
    (which imports cli_args)."""
    import inspect

    from qwenserve.entrypoints.cli import build_parser
    from qwenserve.entrypoints.openai import cli_args

    source = inspect.getsource(cli_args)
    assert "api_server" not in source and "MethodType" not in source
    parser = build_parser("serve")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-queued-sequences", "-1"])  # validated as a subparser


def test_help_group_is_one_section_with_every_flag_of_that_group(capsys):
    """--help=<group> (any case): one section holding the group's flags from every place that
    adds them (EngineArgs and the server's extras), and nothing else."""
    with pytest.raises(SystemExit) as e:
        parse(["--help=modelconfig"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.count("ModelConfig:") == 1
    assert "--max-model-len" in out and "--override-generation-config" in out
    assert "--port" not in out and "--block-size" not in out
    with pytest.raises(SystemExit):
        parse(["--help=listgroup"])
    titles = capsys.readouterr().out.split()
    assert titles.count("ModelConfig") == 1 and titles.count("CacheConfig") == 1
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert capsys.readouterr().out.count("\nCacheConfig:") == 1


def test_help_page_and_no_match(capsys, monkeypatch):
    monkeypatch.setenv("PAGER", "cat")
    with pytest.raises(SystemExit) as e:
        parse(["--help=page"])  # the full help through a pager (plain text off a terminal)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--max-num-seqs" in out and "--port" in out
    with pytest.raises(SystemExit) as e:
        parse(["--help=no-such-thing"])
    assert e.value.code == 1 and "No group or parameter matching" in capsys.readouterr().out


def test_help_reads_no_argparse_internals():
    """Issue 14: the serve parser keeps its own record of groups and flags."""
    import inspect

    from qwenserve.entrypoints.openai import cli_args, cli_data_parallel, cli_help

    for module in (cli_args, cli_help, cli_data_parallel):
        source = inspect.getsource(module)
        for private in ("._actions", "._action_groups", "._group_actions", "argparse._"):
            assert private not in source, (module.__name__, private)
