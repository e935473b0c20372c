"""Pooling models against Hugging Face on tiny random weights (fp32): Qwen3-Embedding's
last-token embeddings (AutoModel), Qwen3-Reranker's yes/no logit score (AutoModelForCausalLM),
batched and over chunked prefill."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tiny_pooling import RERANKER_OVERRIDES, make_tiny_embedding, make_tiny_reranker
from qwenserve import LLM
from qwenserve.pooling import embedding, relevance

PROMPTS = [[5, 17, 99, 3, 250, 8] * 6, [42, 7, 300], [11] * 20]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return make_tiny_embedding(str(tmp_path_factory.mktemp("emb") / "qwen3-embedding"))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return make_tiny_reranker(str(tmp_path_factory.mktemp("rr") / "qwen3-reranker"))


def test_last_token_embeddings_match_hf_automodel(embedder):
    import transformers as tf

    hf = tf.AutoModel.from_pretrained(embedder, dtype=torch.float32).eval()
    llm = LLM(embedder, dtype="float32", runner="pooling", max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20)
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.pooled), want, atol=1e-4, rtol=1e-4)
        normed = embedding(out.pooled)
        assert math.isclose(sum(v * v for v in normed), 1.0, rel_tol=1e-6)
        cut = embedding(out.pooled, dimensions=16)  # Matryoshka: cut, then normalize
        torch.testing.assert_close(torch.tensor(cut), torch.nn.functional.normalize(
            want[:16], dim=0), atol=1e-5, rtol=1e-4)
    llm.llm_engine.shutdown()


def test_reranker_score_is_the_yes_no_logit_of_hf(reranker):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(reranker, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(reranker)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    llm = LLM(reranker, dtype="float32", runner="pooling", hf_overrides=RERANKER_OVERRIDES,
              max_num_batched_tokens=16, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.config.pooler.token_ids == (no, yes)
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1]
        want = float(torch.softmax(logits[[no, yes]], dim=0)[1])  # P(yes) of the 2-way softmax
        assert relevance(out.pooled) == pytest.approx(want, abs=1e-5)
    llm.llm_engine.shutdown()


def test_reward_task_gives_every_tokens_hidden_state(embedder):
    """vLLM's older ``--task reward`` (its ``as_reward_model``) on a checkpoint without a head."""
    import transformers as tf

    hf = tf.AutoModel.from_pretrained(embedder, dtype=torch.float32).eval()
    llm = LLM(embedder, dtype="float32", task="reward", max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20)
    out = llm.encode([{"prompt_token_ids": PROMPTS[0]}])[0]
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).last_hidden_state[0]
    torch.testing.assert_close(torch.tensor(out.pooled), want, atol=1e-4, rtol=1e-4)
    llm.llm_engine.shutdown()
