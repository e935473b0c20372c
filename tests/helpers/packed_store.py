"""The process-wide stores of packed weights (``PackedWeights``) hold other tests' weights too,
and a weight's copy leaves its store when the weight is collected: for cyclic garbage that is
whenever the collector next runs, maybe in the middle of a test. A test that counts what it adds
takes its baseline once that garbage is gone."""

from __future__ import annotations

import gc

from qwenserve.platforms.cpu_packed_gemm import PackedWeights


def settled_packed_bytes(store: PackedWeights) -> int:
    """``store.packed_bytes`` after a collection: earlier tests' unreachable weights already out."""
    gc.collect()
    return store.packed_bytes
