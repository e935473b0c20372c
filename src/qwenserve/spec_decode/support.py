"""Which models and settings speculative decoding runs with, checked before anything loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.core.cache.spec import CacheSpec, RecurrentStateSpec
from qwenserve.spec_decode.config import DRAFT_MODEL, EAGLE3, MTP, mtp_num_layers

if TYPE_CHECKING:
    from qwenserve.config import EngineConfig


def check_speculative(config: EngineConfig, specs: list[CacheSpec], draft_specs: list[CacheSpec],
                      has_mtp_head: bool = False) -> None:
    """``ValueError`` naming what is missing when ``config.speculative`` cannot run."""
    spec = config.speculative
    if spec is None:
        return
    if spec.method == MTP:
        _check_mtp(config, has_mtp_head)
    draft_tensor_parallel_size(config)  # refuses values other than 1 or the target's TP
    draft = config.draft_model
    if draft is None:
        return
    if any(isinstance(s, RecurrentStateSpec) for s in draft_specs):
        raise ValueError(f"--speculative-config model {spec.model}: a hybrid drafter "
                         f"({draft.architecture}) is not supported; use a dense model such as "
                         "Qwen3-0.6B")
    if draft.vocab_size != config.model.vocab_size:
        raise ValueError(f"--speculative-config model {spec.model} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {config.model.vocab_size}: a "
                         "drafter must share the target's tokenizer")


def draft_tensor_parallel_size(config: EngineConfig) -> int:
    """How many ranks shard the drafter: the target's TP (vLLM's default), or 1 (a draft
    model on the driver rank only). MTP and EAGLE-3 heads share the target's embedding and LM
    head, so they are sharded like the target; n-gram lookup runs on the driver."""
    spec, tp = config.speculative, config.parallel.tensor_parallel_size
    assert spec is not None
    size = spec.draft_tensor_parallel_size
    if size is None:
        return tp if spec.method in (MTP, EAGLE3, DRAFT_MODEL) else 1
    if size not in (1, tp):
        raise ValueError(f"--speculative-config draft_tensor_parallel_size={size}: use 1 or the "
                         f"target's --tensor-parallel-size ({tp})")
    if size != tp and spec.method in (MTP, EAGLE3):
        raise ValueError(f"--speculative-config draft_tensor_parallel_size={size} with method "
                         f"{spec.method}: the head shares the target's embedding and LM head, "
                         f"so it runs with the target's --tensor-parallel-size ({tp}); remove "
                         "draft_tensor_parallel_size")
    return size


def _check_mtp(config: EngineConfig, has_mtp_head: bool) -> None:
    arch = config.model.architecture
    if not has_mtp_head:
        raise ValueError(f"--speculative-config method mtp: {arch} has no multi-token-"
                         "prediction head in qwenserve (Qwen3.5, Qwen3.5-MoE and Qwen3-Next "
                         "do); use ngram or draft_model")
    layers = mtp_num_layers(config.model.hf_config)
    if layers != 1:
        raise ValueError(f"--speculative-config method mtp: mtp_num_hidden_layers={layers} is "
                         "not supported (the published Qwen3.5 / Qwen3-Next heads have 1)")
    if config.load_format == "sharded_state":
        raise ValueError("--speculative-config method mtp with --load-format sharded_state is "
                         "not implemented (the saved shards hold no MTP head)")
