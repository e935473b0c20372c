"""M-RoPE for [3, T] positions against HF's rotary modules (Qwen3.5, Qwen3-VL, Qwen2-VL)."""

from __future__ import annotations

import pytest
import torch

from qwenserve.layers.mrope import MRotaryEmbedding, axis_of_frequency, mrope_layout
from qwenserve.layers.rotary import RotaryEmbedding

T = 40


def positions_3d(seed: int) -> torch.Tensor:
    """Three different rows, as image tokens have."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (3, T), generator=gen)


def hf_case(family: str):
    """(HF text config, HF rotary class, HF apply function, head_dim, rotary_dim)."""
    import transformers as tf
    from transformers.models.qwen2_vl import modeling_qwen2_vl as q2
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_vl import modeling_qwen3_vl as q3vl

    if family == "qwen3_5":  # partial rotary: 16 of 32 dims, 8 frequencies
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                "mrope_section": [3, 3, 2], "mrope_interleaved": True}
        cfg = tf.Qwen3_5TextConfig(head_dim=32, rope_parameters=rope)
        return cfg, q35.Qwen3_5TextRotaryEmbedding, q35.apply_rotary_pos_emb, 32, 16
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [4, 2, 2],
                "mrope_interleaved": True}
        cfg = tf.Qwen3VLTextConfig(head_dim=16, rope_parameters=rope)
        return cfg, q3vl.Qwen3VLTextRotaryEmbedding, q3vl.apply_rotary_pos_emb, 16, 16
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    cfg = tf.Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    return cfg, q2.Qwen2VLRotaryEmbedding, q2.apply_rotary_pos_emb, 16, 16


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl", "qwen2_vl"])
def test_matches_hf(family):
    cfg, hf_rotary, hf_apply, head_dim, rotary_dim = hf_case(family)
    # Qwen2-VL's config has no mrope_interleaved: its family's layout is the chunked one
    section, interleaved = mrope_layout(cfg.rope_parameters, family != "qwen2_vl")
    assert interleaved == (family != "qwen2_vl")
    ours = MRotaryEmbedding(cfg, head_dim, rotary_dim, 512, section, interleaved)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(T, 4, head_dim, generator=gen)
    k = torch.randn(T, 2, head_dim, generator=gen)
    positions = positions_3d(2)
    cos, sin = hf_rotary(cfg)(q, positions[:, None, :])  # [1, T, rotary_dim]
    want_q, want_k = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=0)


def test_equal_rows_are_plain_rope():
    cfg, *_ = hf_case("qwen3_5")
    mrope = MRotaryEmbedding(cfg, 32, 16, 512, [3, 3, 2], True)
    plain = RotaryEmbedding(cfg, 32, 16, 512)
    q, k = torch.randn(T, 4, 32), torch.randn(T, 2, 32)
    pos = torch.randint(0, 500, (T,))
    want = plain(pos, q, k)
    for got in (mrope(pos, q, k), mrope(pos.expand(3, -1), q, k)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_axis_layouts():
    # Qwen3.5's published section: 11 + 11 + 10 = 32 frequencies of its 64 rotary dims
    axes = axis_of_frequency([11, 11, 10], True, 32).tolist()
    assert axes[:7] == [0, 1, 2, 0, 1, 2, 0]
    assert axes.count(1) == 11 and axes.count(2) == 10 and axes[29:] == [2, 0, 1]
    assert axis_of_frequency([2, 1, 1], False, 4).tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match=r"sums to 31 but the rotary embedding has 32"):
        axis_of_frequency([11, 10, 10], True, 32)
    with pytest.raises(ValueError, match="must list 3 sizes"):
        mrope_layout({"mrope_section": [8, 8]}, True)
