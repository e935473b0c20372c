"""``bench serve`` accepts vLLM's flag names with vLLM's defaults (``vllm/benchmarks/serve.py``
and ``datasets/arg_utils.py``), so a ``vllm bench serve`` command line runs unchanged."""

from __future__ import annotations

import argparse
import math

import pytest

from qwenserve.tools.bench.serve_args import add_serve_arguments

VLLM_DEFAULTS = {
    "backend": "openai", "base_url": None, "host": "127.0.0.1", "port": 8000, "model": None,
    "served_model_name": None, "tokenizer": None, "tokenizer_mode": "auto",
    "trust_remote_code": False, "dataset_name": "random", "dataset_path": None,
    "num_prompts": 1000, "input_len": None, "output_len": None, "sharegpt_output_len": None,
    "random_input_len": 1024, "random_output_len": 128, "random_range_ratio": 0.0,
    "random_prefix_len": 0, "prefix_repetition_prefix_len": 256,
    "prefix_repetition_suffix_len": 256, "prefix_repetition_num_prefixes": 10,
    "prefix_repetition_output_len": 128, "disable_shuffle": False, "no_oversample": False,
    "seed": 0, "burstiness": 1.0, "max_concurrency": None, "ignore_eos": False,
    "logprobs": None, "extra_body": None, "disable_tqdm": False,
    "percentile_metrics": "ttft,tpot,itl", "metric_percentiles": "99", "goodput": None,
    "save_result": False, "save_detailed": False,
    "result_dir": None, "result_filename": None, "label": None, "metadata": None,
    "header": None, "ready_check_timeout_sec": 0, "temperature": None, "top_p": None,
    "top_k": None, "min_p": None, "frequency_penalty": None, "presence_penalty": None,
    "repetition_penalty": None,
}  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_vllms() -> None:
    args = vars(parse([]))
    assert {k: args[k] for k in VLLM_DEFAULTS} == VLLM_DEFAULTS
    assert math.isinf(args["request_rate"])
    assert args["warmup_requests"] == 20  # the one deliberate change (vLLM: 0)


def test_a_vllm_command_line_parses() -> None:
    args = parse("--backend openai-chat --endpoint /v1/chat/completions --model m "
                 "--dataset-name prefix_repetition --num-prompts 50 --request-rate 4.5 "
                 "--burstiness 0.5 --max-concurrency 8 --ignore-eos --percentile-metrics "
                 "ttft,e2el --metric-percentiles 50,99 --goodput ttft:500 tpot:50 --seed 3 "
                 "--save-result --result-dir out --result-filename r.json --num-warmups 0 "
                 "--trust-remote-code --tokenizer-mode hf --header a=b".split())  # fmt: skip
    assert (args.request_rate, args.burstiness, args.max_concurrency) == (4.5, 0.5, 8)
    assert args.goodput == ["ttft:500", "tpot:50"] and args.warmup_requests == 0
    assert args.dataset_name == "prefix_repetition" and args.header == ["a=b"]


@pytest.mark.parametrize("name", ["sharegpt", "random", "prefix-repetition", "prefix_repetition"])
def test_dataset_names(name: str) -> None:
    assert parse(["--dataset-name", name]).dataset_name == name
