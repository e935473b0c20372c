"""``bench throughput`` and ``bench latency``: arithmetic, wiring, a real run on the engine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qwenserve.tools.bench import latency, throughput


def test_throughput_summary() -> None:
    r = throughput.summarize(elapsed_s=2.0, num_requests=10, prompt_tokens=300, output_tokens=100)
    assert r == {
        "elapsed_time": 2.0, "num_requests": 10, "total_num_tokens": 400,
        "requests_per_second": 5.0, "tokens_per_second": 200.0, "output_tokens_per_second": 50.0,
        "total_prompt_tokens": 300, "total_output_tokens": 100,
    }  # fmt: skip


def test_latency_summary_and_prompts() -> None:
    r = latency.summarize(np.array([1.0, 2.0, 3.0, 4.0]))
    assert r["avg_latency"] == 2.5 and r["std_latency"] == pytest.approx(1.118034)
    assert r["percentiles"][50] == 2.5 and r["percentiles"][10] == pytest.approx(1.3)
    prompts = latency.dummy_prompts(batch_size=3, input_len=5, vocab_size=300, seed=0)
    ids = np.array([p["prompt_token_ids"] for p in prompts])
    assert ids.shape == (3, 5) and ids.max() < 300


class FakeLLM:
    """Stands in for ``qwenserve.LLM``: echoes each request's max_tokens as generated tokens."""

    def __init__(self, tokenizer, max_model_len: int = 4096) -> None:  # noqa: ANN001
        self.tokenizer, self.calls = tokenizer, []
        scheduler = SimpleNamespace(max_model_len=max_model_len)
        self.llm_engine = SimpleNamespace(config=SimpleNamespace(scheduler=scheduler))

    def get_tokenizer(self):  # noqa: ANN201
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=True):  # noqa: ANN001, ANN201
        self.calls.append((prompts, params))
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [
            SimpleNamespace(
                prompt_token_ids=p["prompt_token_ids"] if isinstance(p, dict) else [0] * 16,
                outputs=[SimpleNamespace(token_ids=[1] * sp.max_tokens) for _ in range(sp.n)],
            )
            for p, sp in zip(prompts, params, strict=True)
        ]


def parse(argv: list[str]):  # noqa: ANN201
    import argparse

    from qwenserve.tools.bench import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_throughput_wiring(monkeypatch, tiny_tokenizer_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    fake = FakeLLM(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))
    monkeypatch.setattr(throughput, "make_llm", lambda args: fake)
    out = tmp_path / "t.json"
    args = parse(["throughput", "--model", "m", "--input-len", "16", "--output-len", "5",
                  "--num-prompts", "4", "--n", "2", "--output-json", str(out)])  # fmt: skip
    assert throughput.run(args) == 0
    prompts, params = fake.calls[0]
    assert len(prompts) == 4 and all(isinstance(p, str) for p in prompts)
    assert all(
        p.ignore_eos and p.max_tokens == 5 and p.n == 2 and p.temperature == 1.0 for p in params
    )
    r = json.loads(out.read_text())
    assert r["num_requests"] == 4 and r["total_output_tokens"] == 4 * 2 * 5
    assert "Throughput: " in capsys.readouterr().out


def test_latency_defaults_and_wiring(monkeypatch, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    fake = FakeLLM(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))
    monkeypatch.setattr(latency, "make_llm", lambda args: fake)
    out = tmp_path / "l.json"
    args = parse(["latency", "--model", "m", "--input-len", "6", "--output-len", "3",
                  "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
                  "--output-json", str(out)])  # fmt: skip
    assert args.enable_prefix_caching is False  # vLLM turns it off for latency runs
    assert latency.run(args) == 0
    assert len(fake.calls) == 4  # one warm-up + three measured
    assert len(json.loads(out.read_text())["latencies"]) == 3


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_too_long_for_max_model_len_is_one_line(
    monkeypatch, tiny_tokenizer_dir: Path, run_cli, command: str
) -> None:  # noqa: ANN001
    """vLLM asserts prompt + output <= max_model_len before generating; so do we, in one line."""
    from transformers import AutoTokenizer

    fake = FakeLLM(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)), max_model_len=20)
    module = throughput if command == "throughput" else latency
    monkeypatch.setattr(module, "make_llm", lambda args: fake)
    size = ["--num-prompts", "2"] if command == "throughput" else ["--batch-size", "2"]
    code, _, err = run_cli(["bench", command, "--model", "m", "--input-len", "16",
                            "--output-len", "5", *size])  # fmt: skip
    assert code == 1 and fake.calls == []
    # random prompts re-encode to about --input-len tokens; latency's are exact
    needed = int(err.split("needs ")[1].split()[0]) if "needs " in err else 0
    assert err.startswith("error: a request needs ") and err.count("\n") == 1
    assert needed == 21 if command == "latency" else needed > 20
    assert "max_model_len is 20" in err and "--max-model-len" in err


def test_real_engine(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    from helpers.tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", str(tmp_path / "m"))
    engine = ["--model", model, "--dtype", "float32", "--max-model-len", "128",
              "--kv-cache-memory-bytes", "32M"]  # fmt: skip
    code, _, err = run_cli(
        [
            "bench",
            "throughput",
            *engine,
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--num-prompts",
            "4",
            "--output-json",
            str(tmp_path / "t.json"),
        ]
    )
    assert code == 0, err
    r = json.loads((tmp_path / "t.json").read_text())
    assert r["num_requests"] == 4 and r["total_output_tokens"] == 16
    code, _, err = run_cli(["bench", "latency", *engine, "--input-len", "8", "--output-len", "4",
                            "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "2",
                            "--output-json", str(tmp_path / "l.json")])  # fmt: skip
    assert code == 0, err
    assert len(json.loads((tmp_path / "l.json").read_text())["latencies"]) == 2
