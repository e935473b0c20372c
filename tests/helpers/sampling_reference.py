"""An independent NumPy reference of the sampling filters (vLLM's order), for the sampler's tests."""

from __future__ import annotations

import numpy as np


def reference_probs(logits: np.ndarray, p: dict) -> np.ndarray:
    """vLLM's order: temperature, then min_p on the scaled distribution, then top_k, then
    top_p over what top_k kept (renormalised), keeping the smallest set of most likely tokens
    whose mass reaches top_p."""
    z = logits.astype(np.float64) / p["temperature"]
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    if p.get("min_p"):
        keep &= probs >= p["min_p"] * probs.max()
    order = np.argsort(-np.where(keep, probs, -1.0), kind="stable")  # most likely first
    if p.get("top_k"):
        keep[order[p["top_k"]:]] = False
    if p.get("top_p", 1.0) < 1.0:
        kept = np.where(keep, probs, 0.0)
        mass = np.cumsum(kept[order]) / kept.sum()
        size = int(np.searchsorted(mass, p["top_p"])) + 1  # first index where mass >= top_p
        keep[order[size:]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()
