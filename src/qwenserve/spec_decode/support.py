"""Which models and settings speculative decoding runs with, checked before anything loads."""

from __future__ import annotations

from typing import Any

from qwenserve.core.cache.spec import CacheSpec, RecurrentStateSpec
from qwenserve.spec_decode.config import DRAFT_MODEL


def check_speculative(config: Any, specs: list[CacheSpec]) -> None:
    """``ValueError`` naming what is missing when ``config.speculative`` cannot run."""
    spec = config.speculative
    if spec is None:
        return
    if any(isinstance(s, RecurrentStateSpec) for s in specs):
        raise ValueError(
            f"--speculative-config: speculative decoding on {config.model.architecture} (a "
            "hybrid model with Gated DeltaNet layers) is not implemented yet: rejected draft "
            "tokens would need the recurrent state rolled back to the last accepted token. "
            "Remove --speculative-config for this model.")
    if spec.method == DRAFT_MODEL:
        raise ValueError("--speculative-config method draft_model is not implemented yet; "
                         "use ngram")
