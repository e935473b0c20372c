"""Tiny random-weight vision towers and images, written with transformers (the reference)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from helpers.tiny_models import randomize_

# patch 4 -> 96 values per patch; head_dim 16 (4 rotary frequencies per axis); a 4 x 4 table
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
              in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16, hidden_act="gelu_pytorch_tanh")


def vision_config(family: str, **overrides: Any) -> Any:
    """HF vision config of ``family`` "qwen3_5" or "qwen3_vl" (with deep-stack taps)."""
    import transformers as tf

    kw = dict(VISION, **overrides)
    if family == "qwen3_vl":
        kw.setdefault("deepstack_visual_indexes", [0, 2])
        return tf.Qwen3VLVisionConfig(**kw)
    return tf.Qwen3_5VisionConfig(**kw)


def hf_vision_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    import transformers as tf

    cfg = vision_config(family, **overrides)
    cls = (tf.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel if family == "qwen3_vl"
           else tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, dtype=torch.float32).eval()
    randomize_(model, seed)
    return model


def random_pixels(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    """Normalized-looking pixel patches for the given grids, [N, 3 * 2 * 4 * 4]."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    dim = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    return torch.randn(n, dim, generator=gen)


def random_image(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def write_preprocessor_config(path: str, **overrides: Any) -> str:
    """Qwen3-VL / Qwen3.5's published preprocessor_config.json, scaled to the tiny tower
    (patch 4, merge 2: sides are multiples of 8 pixels)."""
    import json
    import os

    cfg = {"image_processor_type": "Qwen2VLImageProcessorFast",
           "processor_class": "Qwen3VLProcessor", "patch_size": VISION["patch_size"],
           "temporal_patch_size": VISION["temporal_patch_size"],
           "merge_size": VISION["spatial_merge_size"],
           "size": {"shortest_edge": 8 * 8, "longest_edge": 64 * 64},
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], **overrides}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def vl_tokenizer() -> Any:
    """The tiny tokenizer plus Qwen's vision tokens (ids 512..515)."""
    from helpers.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    return tokenizer


def hf_vl_model(family: str, seed: int = 0) -> Any:
    """A tiny HF ``Qwen3_5Model`` / ``Qwen3VLModel`` (tower + decoder) with random weights."""
    import transformers as tf

    from helpers.tiny_models import _config

    start, end, pad, video = vl_tokenizer().convert_tokens_to_ids(IMAGE_TOKENS)
    ids = dict(image_token_id=pad, video_token_id=video, vision_start_token_id=start,
               vision_end_token_id=end)
    if family == "qwen3_5":
        text = _config("qwen3_5", vocab_size=520).to_dict()
        cfg = tf.Qwen3_5Config(text_config=text, vision_config={**VISION, "out_hidden_size": 64},
                               **ids)
        model_cls = tf.Qwen3_5Model
    elif family == "qwen3_5_moe":
        text = _config("qwen3_5_moe", vocab_size=520).to_dict()
        cfg = tf.Qwen3_5MoeConfig(text_config=text,
                                  vision_config={**VISION, "out_hidden_size": 64}, **ids)
        model_cls = tf.Qwen3_5MoeModel
    else:
        text = dict(vocab_size=520, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                     "mrope_section": [2, 2, 2], "mrope_interleaved": True})
        vision = {**VISION, "out_hidden_size": 48, "deepstack_visual_indexes": [0, 1]}
        if family == "qwen3_vl_moe":  # every layer sparse, 4 experts of 32, top 2
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
            cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
            model_cls = tf.Qwen3VLMoeModel
        else:
            cfg = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
            model_cls = tf.Qwen3VLModel
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize_(model, seed)
    return model


def make_tiny_vl_checkpoint(family: str, path: str, seed: int = 0) -> str:
    """A ``*ForConditionalGeneration`` folder (tower + decoder, random weights) with the
    tokenizer and preprocessor_config.json, as published checkpoints ship (skipped if there)."""
    import os

    import transformers as tf

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    base = hf_vl_model(family, seed)
    cls = {"qwen3_5": tf.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration,
           "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
           "qwen3_vl_moe": tf.Qwen3VLMoeForConditionalGeneration}[family]
    tokenizer = vl_tokenizer()
    cfg = base.config
    cfg.text_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    write_preprocessor_config(path)
    return path


def load_hf_vl(path: str) -> Any:
    import transformers as tf

    return tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_vl_greedy(model: Any, prompt_ids: list[int], processed: list[Any],
                 max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs by full recomputation each step (the plainest
    reference: HF's own M-RoPE index over the whole sequence every time)."""
    ids = list(prompt_ids)
    kwargs = {}
    if processed:
        kwargs = dict(pixel_values=torch.cat([p.pixel_values for p in processed]),
                      image_grid_thw=torch.tensor([p.grid_thw for p in processed]))
    logprobs = []
    for _ in range(max_new_tokens):
        t = torch.tensor([ids])
        extra = dict(kwargs, mm_token_type_ids=(t == model.config.image_token_id).int()
                     ) if processed else {}
        logits = model(input_ids=t, **extra).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt_ids):], logprobs
