"""``--load-format sharded_state``: files written per rank by scripts/save_sharded_state.py load
back into the same layout (TP=2 with expert parallelism here) and give the original model's
greedy tokens; another layout is refused with the one to use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qwenserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")
PROMPTS = [[5, 17, 99, 3], list(range(10, 40))]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def greedy(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_written_per_rank_and_loaded_back(tiny_model, tmp_path):
    path, out = tiny_model("qwen3_moe"), str(tmp_path / "sharded")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "save_sharded_state.py"),
                    "--model", path, "--output", out, "-tp", "2", "--enable-expert-parallel",
                    "--dtype", "float32"], check=True,
                   env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    names = sorted(os.listdir(out))
    assert "model-rank-0-part-0.safetensors" in names and "model-rank-1-part-0.safetensors" in names
    assert "config.json" in names and "tokenizer.json" in names
    assert "model.safetensors" not in names
    assert greedy(out, load_format="sharded_state", tensor_parallel_size=2,
                  enable_expert_parallel=True) == greedy(path)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2"):
        greedy(out, load_format="sharded_state")
