"""RoPE scaling variants (linear, llama3, and yarn, the scaling long-context Qwen uses) equal
Hugging Face at positions beyond the original context window: the rotation itself, and a whole
model's prompt logprobs and greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from helpers.tiny_models import hf_greedy, hf_logits, load_hf_model
from qwenserve import LLM, SamplingParams
from qwenserve.layers.rotary import RotaryEmbedding

WINDOW = 64  # the "original" context; the tests run to several times it
VARIANTS = {
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": WINDOW,
                         "rope_theta": 500000.0}),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": WINDOW, "rope_theta": 1e6}),
}


def llama_config(rope: dict) -> tf.LlamaConfig:
    return tf.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, max_position_embeddings=4 * WINDOW,
                          rope_parameters=dict(rope))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rotation_equals_hf_beyond_the_window(variant):
    rope = VARIANTS[variant][1]
    config = llama_config(rope)
    positions = torch.arange(4 * WINDOW)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 2, 32, generator=gen)  # [T, Hq, D]
    k = torch.randn(len(positions), 1, 32, generator=gen)  # [T, Hkv, D]
    ours = RotaryEmbedding(config, 32, 32, 4 * WINDOW)
    got_q, got_k = ours(positions, q, k)
    hf = LlamaRotaryEmbedding(config)
    cos, sin = hf(q, positions[None])  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)  # [1, H, T, D]
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    # the scaling is in effect: past the window the rotation differs from unscaled RoPE
    plain = RotaryEmbedding(llama_config({"rope_type": "default",
                                          "rope_theta": rope["rope_theta"]}), 32, 32, 4 * WINDOW)
    far = positions >= WINDOW
    assert not torch.allclose(plain(positions, q, k)[0][far], got_q[far], atol=1e-2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_equals_hf_beyond_the_window(tiny_model, variant):
    """Prompt logprobs at positions 1..159 (up to 2.5x the window) within 1e-4 of HF's in fp32
    (the dense models' measured fp32 error is ~5e-6, tests/models/test_parity.py), chunked in
    steps of 32 tokens, then greedy tokens equal to HF's."""
    arch, rope = VARIANTS[variant]
    path = tiny_model(arch, rope_parameters=rope)
    hf = load_hf_model(path)
    prompt = [(i * 37) % 500 + 3 for i in range(160)]
    llm = LLM(path, dtype="float32", max_model_len=192, max_num_batched_tokens=32,
              kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # [T, V]
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        got = entry[prompt[pos]].logprob
        assert got == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4), pos
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
