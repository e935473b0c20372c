"""Reward models against a plain-PyTorch reference of Qwen2.5-Math-RM's own modeling code on the
same tiny random weights (fp32): HF's ``Qwen2Model`` body, then ``score`` = Linear -> ReLU ->
Linear on every token (the hub's ``modeling_qwen2_rm.py`` pools the last token of that; vLLM
returns them all). Also ``--convert reward`` on a causal LM (every token's hidden state)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tiny_models import make_tiny_model
from helpers.tiny_pooling import make_tiny_reward_model, reference_rewards
from qwenserve import LLM

# longer than the step budget below: the first prompt is prefilled over several chunks
PROMPTS = [[5, 17, 99, 3, 250, 8] * 6, [42, 7, 300], [11] * 20]


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory):
    return make_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "qwen2.5-math-rm"))


def test_every_token_reward_matches_the_reference(reward_path):
    llm = LLM(reward_path, dtype="float32", max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20)
    config = llm.llm_engine.config
    assert config.pooler.kind == "reward" and config.pooler.num_labels == 1
    assert not config.cache.enable_prefix_caching  # every token must be computed
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], pooling_task="token_classify")
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = reference_rewards(reward_path, prompt)
        got = torch.tensor(out.pooled)
        assert got.shape == (len(prompt), 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # LLM.reward: raw by default (vLLM 0.32), sigmoid with use_activation
    raw = llm.reward([{"prompt_token_ids": PROMPTS[1]}])[0].pooled
    act = llm.reward([{"prompt_token_ids": PROMPTS[1]}], use_activation=True)[0].pooled
    # one prompt alone runs other GEMM kernels than the batch (skinny rows): equal to rounding
    torch.testing.assert_close(torch.tensor(raw), torch.tensor(outs[1].pooled), atol=1e-5, rtol=1e-5)
    assert [a for (a,) in act] == pytest.approx([1 / (1 + math.exp(-r)) for (r,) in raw],
                                                rel=1e-6)
    with pytest.raises(ValueError, match="Unsupported task: 'embed'"):
        llm.encode("hi", pooling_task="embed")
    llm.llm_engine.shutdown()


def test_convert_reward_returns_every_tokens_hidden_state(tmp_path):
    import transformers as tf

    path = make_tiny_model("qwen2", str(tmp_path / "qwen2"))
    llm = LLM(path, dtype="float32", convert="reward", max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.config.pooler.num_labels == 0
    hf = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS[:2]])
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(torch.tensor(out.pooled), want, atol=1e-4, rtol=1e-4)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    ({"convert": "embed"}, "is a reward model"),
    ({"runner": "generate"}, "Qwen2ForRewardModel; use --runner pooling"),
])
def test_reward_model_refuses_other_tasks(reward_path, kwargs, match):
    from qwenserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(model=reward_path, **kwargs).create_engine_config()
