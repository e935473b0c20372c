"""Which models and settings speculative decoding runs with, checked before anything loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.core.cache.spec import CacheSpec, RecurrentStateSpec
from qwenserve.spec_decode.config import EAGLE3, MTP, mtp_num_layers

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
    if spec.method == EAGLE3 and config.parallel.tensor_parallel_size > 1:
        raise ValueError("--speculative-config method eagle3 with --tensor-parallel-size > 1 is "
                         "not implemented yet (the head runs on the driver rank only); use TP=1 "
                         "or remove --speculative-config")
    if (any(isinstance(s, RecurrentStateSpec) for s in specs)
            and config.parallel.tensor_parallel_size > 1):
        raise ValueError(
            f"--speculative-config on {config.model.architecture} (a hybrid model with Gated "
            "DeltaNet layers) with --tensor-parallel-size > 1 is not implemented yet: every "
            "rank would need the accepted counts to roll its recurrent state back. Use TP=1 "
            "or remove --speculative-config.")
    draft = config.draft_model
    if draft is None:
        return
    if any(isinstance(s, RecurrentStateSpec) for s in draft_specs):
        raise ValueError(f"--speculative-config model {spec.model}: a hybrid drafter "
                         f"({draft.architecture}) is not supported; use a dense model such as "
                         "Qwen3-0.6B")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--speculative-config method draft_model with "
                         "--tensor-parallel-size > 1 is not implemented yet; use ngram or TP=1")
    if draft.vocab_size != config.model.vocab_size:
        raise ValueError(f"--speculative-config model {spec.model} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {config.model.vocab_size}: a "
                         "drafter must share the target's tokenizer")


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
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--speculative-config method mtp with --tensor-parallel-size > 1 is "
                         "not implemented yet (the head runs on the driver rank only); use TP=1 "
                         "or remove --speculative-config")
    if config.load_format == "sharded_state":
        raise ValueError("--speculative-config method mtp with --load-format sharded_state is "
                         "not implemented (the saved shards hold no MTP head)")
