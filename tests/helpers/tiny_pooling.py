"""Tiny random-weight pooling models, laid out like the real checkpoints:

- Qwen3-Embedding: saved from the bare decoder (``Qwen3Model``: ``layers.0...``, no LM head)
  with ``architectures: ["Qwen3ForCausalLM"]`` in config.json, as the hub's files are;
- Qwen3-Reranker: a Qwen3 causal LM whose tokenizer has ``yes`` and ``no`` tokens (vLLM serves it
  with ``--hf-overrides`` naming those tokens).
"""

from __future__ import annotations

import json
import os

import torch

from helpers.tiny_models import _config, build_tokenizer, make_tiny_model, randomize_

RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                      "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


def make_tiny_embedding(path: str, seed: int = 0) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import transformers as tf

    config = _config("qwen3", tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.AutoModel.from_config(config, dtype=torch.float32).eval()  # Qwen3Model
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return path


def make_tiny_reranker(path: str, seed: int = 0) -> str:
    if os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(
            os.path.join(path, "config.json")):
        return path
    make_tiny_model("qwen3", path, seed=seed)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["yes", "no"])  # ids 460, 461: inside the model's 512 rows
    tokenizer.save_pretrained(path)
    return path
