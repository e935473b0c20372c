"""Tiny random-weight pooling models, laid out like the real checkpoints:

- Qwen3-Embedding: saved from the bare decoder (``Qwen3Model``: ``layers.0...``, no LM head)
  with ``architectures: ["Qwen3ForCausalLM"]`` in config.json, as the hub's files are;
- Qwen3-Reranker: a Qwen3 causal LM whose tokenizer has ``yes`` and ``no`` tokens (vLLM serves it
  with ``--hf-overrides`` naming those tokens).
"""

from __future__ import annotations

import json
import os
from typing import Any

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


def make_tiny_reward_model(path: str, seed: int = 0, **overrides: Any) -> str:
    """A Qwen2.5-Math-RM-shaped checkpoint: the Qwen2 body (``model.*``, no LM head) and the score
    head ``score.0`` (Linear H->H) -> ReLU -> ``score.2`` (Linear H->1), both with biases, with
    ``architectures: ["Qwen2ForRewardModel"]`` as the hub's config.json says."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import transformers as tf
    from safetensors.torch import save_file

    config = _config("qwen2", **{"tie_word_embeddings": False, **overrides})
    torch.manual_seed(seed)
    body = tf.AutoModel.from_config(config, dtype=torch.float32).eval()  # Qwen2Model
    randomize_(body, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    h = config.hidden_size
    head = {"score.0.weight": 0.15 * torch.randn(h, h, generator=gen),
            "score.0.bias": 0.15 * torch.randn(h, generator=gen),
            "score.2.weight": 0.15 * torch.randn(1, h, generator=gen),
            "score.2.bias": 0.15 * torch.randn(1, generator=gen)}
    weights = {f"model.{k}": v.contiguous() for k, v in body.state_dict().items()}
    os.makedirs(path, exist_ok=True)
    save_file({**weights, **head}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    raw = config.to_dict()
    raw.pop("id2label", None), raw.pop("label2id", None)  # one label, as the hub's config says
    raw.update(architectures=["Qwen2ForRewardModel"], num_labels=1,
               auto_map={"AutoModel": "modeling_qwen2_rm.Qwen2ForRewardModel"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    build_tokenizer().save_pretrained(path)
    return path


def reference_rewards(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), 1]: the checkpoint's remote code, written out (no hub access here)."""
    import transformers as tf
    from safetensors.torch import load_file

    body = tf.Qwen2Model.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(f"{path}/model.safetensors")
    hidden = body.config.hidden_size
    score = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 1))
    score.load_state_dict({k[len("score."):]: v for k, v in tensors.items()
                           if k.startswith("score.")})
    with torch.no_grad():
        return score(body(torch.tensor([prompt])).last_hidden_state)[0]
