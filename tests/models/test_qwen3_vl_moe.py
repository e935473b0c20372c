"""Qwen3-VL-MoE's checkpoint layouts: transformers' fused experts ``[E, 2I, H]`` / ``[E, H, I]``
and the published input-major ``[E, H, 2I]`` / ``[E, I, H]`` load to the same weights; the
LM head is tied as the outer config says, not the text config. (HF parity end to end:
``tests/engine/test_vision_parity.py::test_other_families_match_hf[qwen3_vl_moe]``.)"""

from __future__ import annotations

import torch

from helpers.tiny_vision import hf_vl_model
from qwenserve.models.base import ModelContext
from qwenserve.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration


def build() -> tuple[Qwen3VLMoeForConditionalGeneration, dict[str, torch.Tensor]]:
    import transformers as tf

    base = hf_vl_model("qwen3_vl_moe", seed=3)
    hf = tf.Qwen3VLMoeForConditionalGeneration(base.config)
    hf.model = base
    text = base.config.get_text_config()
    text.vision_config = base.config.vision_config
    text.tie_word_embeddings = False
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    return Qwen3VLMoeForConditionalGeneration(ModelContext(text, torch.float32, 64)), weights


def test_published_and_transformers_expert_layouts_load_the_same():
    ours, weights = build()
    ours.load_weights(weights.items(), "transformers layout")
    want = {k: v.clone() for k, v in ours.state_dict().items()}
    published = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v
                 for k, v in weights.items()}
    assert published["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 64)
    again, _ = build()
    again.load_weights(published.items(), "published layout")
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    assert not ours.tie  # untied: its own lm_head


def test_the_outer_config_decides_tying(tmp_path):
    """Qwen3VLMoeConfig's text config defaults to tied, its outer config to untied; HF unties."""
    import json

    from helpers.tiny_vision import make_tiny_vl_checkpoint
    from qwenserve.models.model_config import read_hf_config

    path = make_tiny_vl_checkpoint("qwen3_vl_moe", str(tmp_path / "ckpt"))
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    assert (raw["tie_word_embeddings"], raw["text_config"]["tie_word_embeddings"]) == (False, True)
    text, _, _ = read_hf_config(path)
    assert text.tie_word_embeddings is False and text.vision_config is not None
