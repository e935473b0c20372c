"""vLLM / vLLM Ascend flags of the tutorials: spellings vLLM's parser accepts, JSON options checked
by key, data-parallel flags for one replica, and a log line for each option that does not act."""

from __future__ import annotations

import io
import logging
from contextlib import redirect_stderr

import pytest

from qwenserve.engine.arg_utils import EngineArgs, log_option_notes
from qwenserve.entrypoints.openai.cli_args import make_serve_parser
from qwenserve.options.additional import parse_additional_config
from qwenserve.options.compilation import parse_compilation_config
from qwenserve.options.hf_overrides import derived_max_model_len, merge_overrides


def parse(argv: list[str]):
    return make_serve_parser().parse_args(["m", *argv])


def refusal(argv: list[str]) -> str:
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit):
        parse(argv)
    return err.getvalue().strip().splitlines()[-1]


def test_underscore_spellings_and_several_served_names():
    ns = parse(["--max_model_len", "16384", "--gpu_memory_utilization", "0.8",
                "--served_model_name", "a", "b", "--distributed_executor_backend", "mp",
                "--hf_overrides", '{"rope_parameters": {"factor": 2}}', "--max-num-seqs", "7",
                "--dtype", "float16", "--seed", "1024"])
    assert ns.max_model_len == 16384 and ns.gpu_memory_utilization == 0.8
    assert ns.served_model_name == ["a", "b"] and ns.hf_overrides["rope_parameters"]["factor"] == 2
    assert ns.max_num_seqs == 7 and ns.dtype == "float16" and ns.seed == 1024
    # values keep their underscores; a dotted key keeps its own
    assert parse(["--served-model-name", "qwen3_235b"]).served_model_name == ["qwen3_235b"]


def test_compilation_config_json_dotted_and_mode():
    ns = parse(["--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}',
                "-cc.cudagraph_capture_sizes=[8,1,4]"])
    assert ns.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY",
                                     "cudagraph_capture_sizes": [1, 4, 8]}
    assert parse(["-O3"]).compilation_config == {"mode": 3}
    assert parse(["-cc", '{"mode": "VLLM_COMPILE"}']).compilation_config == {"mode": 3}
    assert "unknown key 'cudagraph_modes'" in refusal(["-cc", '{"cudagraph_modes": "FULL"}'])
    assert "not a cudagraph mode" in refusal(["-cc", '{"cudagraph_mode": "HALF"}'])
    assert "positive integers" in refusal(["-cc", '{"cudagraph_capture_sizes": [0]}'])
    assert "must be 0 or more" in refusal(["-cc", '{"max_cudagraph_capture_size": -1}'])


def test_startup_notes_name_each_key_and_say_why(caplog):
    args = EngineArgs(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "mode": 3,
                                          "cudagraph_num_of_warmups": 1,
                                          "cudagraph_capture_sizes": [1, 2, 4]},
                      additional_config={"enable_cpu_binding": True, "made_up_key": 1},
                      async_scheduling=True)
    with caplog.at_level(logging.INFO):
        log_option_notes(args, "cpu", True)
    text = caplog.text
    assert 'cudagraph_mode="FULL_DECODE_ONLY": decode-only steps are recorded' in text
    assert "cudagraph_num_of_warmups=1" in text and "no counterpart there" in text
    assert "mode=3" in text and "torch.compile" in text
    assert "cudagraph_capture_sizes=[1, 2, 4]: the decode batch sizes recorded" in text
    assert "enable_cpu_binding" in text and "NUMA" in text
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "made_up_key" in warned[0].getMessage()
    assert "--async-scheduling: no effect yet" in text


def test_additional_config_must_be_an_object():
    assert "expected a JSON object" in refusal(["--additional-config", "[1]"])
    assert parse_additional_config(None).given == {}
    with pytest.raises(ValueError, match="JSON object"):
        parse_compilation_config("[1, 2]")


def test_data_parallel_flags_for_one_replica(caplog):
    with caplog.at_level(logging.INFO):
        ns = parse(["--data-parallel-size", "1", "--data-parallel-size-local", "1",
                    "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "6884"])
    assert ns.data_parallel_size == 1 and "no effect with one data-parallel replica" in caplog.text
    assert "--data-parallel-rank 1: must be in 0..0" in refusal(["--data-parallel-rank", "1"])


def test_data_parallel_layouts_and_refusals():
    from qwenserve.entrypoints.openai.cli_data_parallel import data_parallel_config

    head = data_parallel_config(parse(["-dp", "4", "-dpl", "2", "-dpa", "10.0.0.1",
                                       "-dpp", "13389"]))
    assert head.local_ranks == (0, 1) and head.remote_ranks == (2, 3)
    assert (head.address, head.rpc_port, head.engine_indexes) == ("10.0.0.1", 13389,
                                                                  (0, 1, 2, 3))
    node = data_parallel_config(parse(["--headless", "--data-parallel-size", "4",
                                       "--data-parallel-size-local", "2",
                                       "--data-parallel-start-rank", "2"]))
    assert node.headless and node.local_ranks == (2, 3) and node.remote_ranks == ()
    alone = data_parallel_config(parse(["-dp", "2", "--data-parallel-rank", "1"]))
    assert alone.external and alone.local_ranks == (1,) and alone.engine_indexes == (1,)
    assert data_parallel_config(parse(["-dp", "2"])).local_ranks == (0, 1)
    # DP x EP: one node or several, any tensor parallel size, with speculative decoding
    assert parse(["-dp", "2", "-tp", "2", "--enable-expert-parallel"]).data_parallel_size == 2
    assert parse(["--headless", "-dp", "2", "-dpl", "1", "-dpr", "1",
                  "--enable-expert-parallel"]).headless
    assert parse(["-dp", "2", "--enable-expert-parallel", "--speculative-config",
                  '{"method": "qwen3_5_mtp", "num_speculative_tokens": 2}']).speculative_config
    assert parse(["--api-server-count", "2", "-dp", "2"]).api_server_count == 2
    assert "--headless" in refusal(["--api-server-count", "2", "--headless", "-dp", "2",
                                    "-dpr", "1"])
    assert "--kv-transfer-config" in refusal(["--api-server-count", "2", "--kv-transfer-config",
                                              '{"kv_connector": "MooncakeConnectorV1", '
                                              '"kv_role": "kv_producer"}'])
    assert "--api-server-count 0" in refusal(["--api-server-count", "0"])
    assert "--data-parallel-start-rank" in refusal(["--headless", "-dp", "2"])
    assert "--headless" in refusal(["-dp", "2", "--data-parallel-start-rank", "1"])
    assert "must be 1..1" in refusal(["--headless", "-dp", "2", "-dpl", "2", "-dpr", "1"])
    assert "--data-parallel-size 0" in refusal(["-dp", "0"])
    assert parse(["--api-server-count", "1"]).api_server_count == 1


def test_hf_overrides_merge_and_yarn_length():
    base = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "x": 1}
    merged = merge_overrides(base, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 32768}})
    assert merged["rope_parameters"]["rope_theta"] == 1e6 and merged["x"] == 1
    assert base["rope_parameters"]["rope_type"] == "default"  # inputs untouched

    class Config:
        max_position_embeddings = 40960
        rope_parameters = merged["rope_parameters"]

    assert derived_max_model_len(Config) == 131072  # 32768 x 4, vLLM's figure
    Config.rope_parameters = {"rope_type": "default"}
    assert derived_max_model_len(Config) == 40960
