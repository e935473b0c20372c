"""Pooling models (``--runner pooling``, ``--task embed|score|reward``, ``--convert``): what the
engine returns instead of sampled tokens, resolved once from the flags and the HF config (no torch).

- embed (Qwen3-Embedding): the last prompt token's final hidden state; the API normalizes it,
  after cutting it to ``dimensions`` (Matryoshka), as vLLM does.
- classify from tokens (Qwen3-Reranker, configured as vLLM's guide does with ``--hf-overrides
  '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
  "is_original_qwen3_reranker": true}'``): the LM head's ``yes`` minus ``no`` logit at the last
  token; ``sigmoid`` of it is the relevance score (the probability of "yes" in a 2-way softmax).
- reward, every token (vLLM's "ALL" pooling, served on ``/pooling``): a reward model
  (``Qwen2ForRewardModel``, Qwen2.5-Math-RM) gives each token its score head's output
  (``num_labels`` raw values, as vLLM 0.32 returns them; ``sigmoid`` with ``use_activation``);
  ``--convert reward`` / ``--task reward`` on a causal LM gives each token's final hidden
  state, as vLLM's ``as_reward_model`` did. Prefix caching is off for these: every token must be computed.

A prompt is prefilled and not sampled: the request finishes with its pooled output.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from qwenserve.config import PoolerConfig
    from qwenserve.sampling_params import SamplingParams

RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed", "embedding", "score", "classify", "reward")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
_SEQ_CLS = "ForSequenceClassification"
_REWARD = "ForRewardModel"


def is_reward_architecture(architectures: list[str] | None) -> bool:
    return any(a.endswith(_REWARD) for a in architectures or [])


def wants_pooling(runner: str, task: str, convert: str) -> bool:
    return runner == "pooling" or task not in ("auto", "generate") or convert not in (
        "auto", "none")


def pooling_kind(task: str, convert: str, architectures: list[str] | None,
                 hf_config: PretrainedConfig) -> str:
    """embed | classify | reward, or ValueError naming the flag for what qwenserve does not
    pool."""
    if is_reward_architecture(architectures):
        if task not in ("auto", "reward") or convert not in ("auto", "none", "reward"):
            raise ValueError(f"{architectures[0]} is a reward model: it serves /pooling "
                             "(--task reward or no --task/--convert), not "
                             f"--task {task} --convert {convert}")
        return "reward"
    if "reward" in (task, convert):
        return "reward"
    classify = task in ("score", "classify") or convert == "classify" or any(
        _SEQ_CLS in a for a in architectures or [])
    if not classify:
        return "embed"
    tokens = getattr(hf_config, "classifier_from_token", None)
    if not tokens or len(tokens) != 2:
        raise ValueError(
            "a scoring model needs --hf-overrides with classifier_from_token [negative, "
            "positive] (Qwen3-Reranker: '{\"architectures\": [\"Qwen3ForSequenceClassification\"],"
            " \"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": "
            "true}'); checkpoints with their own classification head are not implemented yet")
    return "classify"


def server_task(pooler: PoolerConfig) -> str:
    """The pooling task a server runs, by vLLM 0.32's name (``/pooling``'s ``task``)."""
    if pooler.kind == "reward":
        return "token_classify" if pooler.num_labels else "token_embed"
    return pooler.kind


def causal_lm_architectures(raw_config: dict) -> list[str] | None:
    """A token classifier (``classifier_from_token``) runs its checkpoint's causal LM: the
    ``...ForSequenceClassification`` name the override sets maps back to ``...ForCausalLM``."""
    archs = raw_config.get("architectures")
    if not archs or "classifier_from_token" not in raw_config:
        return archs
    return [a.replace(_SEQ_CLS, "ForCausalLM") for a in archs]


def classifier_token_ids(tokenizer: PreTrainedTokenizerBase, tokens: list[str]) -> tuple[int, ...]:
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token {token!r} is not one token of the "
                             "model's tokenizer; check --hf-overrides")
        ids.append(int(token_id))
    return tuple(ids)


def pooling_params() -> SamplingParams:
    """The SamplingParams a pooling request carries through the engine: the prompt is the work,
    so it finishes at its last prefill chunk (max_tokens=1 bounds the cache it may take)."""
    from qwenserve.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY,
                          pooling=True)


def embedding(pooled: list[float], dimensions: int | None = None,
              normalize: bool = True) -> list[float]:
    """vLLM's embedding of a pooled hidden state: cut to ``dimensions`` first (Matryoshka),
    then L2-normalize."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(pooled):
            raise ValueError(f"dimensions must be in [1, {len(pooled)}] for this model, got "
                             f"{dimensions}")
        pooled = pooled[:dimensions]
    if not normalize:
        return list(pooled)
    norm = math.sqrt(sum(v * v for v in pooled)) or 1.0
    return [v / norm for v in pooled]


def relevance(pooled: list[float]) -> float:
    """A reranker's score: sigmoid of the positive-minus-negative logit (the 2-way softmax
    probability of the positive token)."""
    return _sigmoid(pooled[0])


def token_rows(pooled: list[list[float]], use_activation: bool | None,
               num_labels: int) -> list[list[float]]:
    """A reward request's per-token output as vLLM 0.32's ``/pooling`` returns it: one row per
    prompt token, raw by default (its reward pooler's ``use_activation=False``); with
    ``use_activation``, a score head's ``sigmoid`` (one label) or softmax (several), and hidden
    states L2-normalized (``token_embed``)."""
    if not use_activation:
        return [list(row) for row in pooled]
    if not num_labels:
        return [embedding(row) for row in pooled]
    return [[_sigmoid(row[0])] if len(row) == 1 else _softmax(row) for row in pooled]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    total = math.fsum(exps)
    return [e / total for e in exps]
