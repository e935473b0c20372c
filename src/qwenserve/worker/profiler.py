"""Peak activation memory of one forward pass at the full token budget (accelerators only)."""

from __future__ import annotations

from typing import Any

import torch

from qwenserve.core.cache.spec import PagedKVSpec
from qwenserve.core.sched_output import NewRequestData, ScheduledChunk, SchedulerOutput
from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.model_runner import ModelRunner


def profile_peak_bytes(worker: Any) -> int:
    """Run a prefill of ``max_num_batched_tokens`` tokens with a throwaway cache; return the
    peak bytes allocated beyond the weights."""
    cfg = worker.config
    num_tokens = min(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_model_len)
    block_size = cfg.cache.block_size
    num_blocks = -(-num_tokens // block_size)
    caches: list[Any] = [None] * cfg.model.num_hidden_layers
    for spec in worker.specs:
        if isinstance(spec, PagedKVSpec):
            for layer_id in spec.layer_ids:
                caches[layer_id] = torch.zeros(2, num_blocks * block_size, spec.num_kv_heads,
                                               spec.head_dim, dtype=worker.dtype,
                                               device=worker.device)
        else:
            for layer_id, state in zip(spec.layer_ids,
                                       worker.model.allocate_state(2, worker.device)):
                caches[layer_id] = state
    platform = worker.platform
    platform.synchronize(worker.device)
    platform.reset_peak_memory_stats(worker.device)
    before = platform.max_memory_allocated(worker.device)
    runner = ModelRunner(worker.model, caches, worker.attn_backend, block_size, worker.device,
                         worker.tp.is_driver, 0, getattr(worker.model, "recurrent_backend", None))
    tokens = [0] * num_tokens
    runner.execute(SchedulerOutput(
        new_requests=[NewRequestData("profile", tokens, [], SamplingParams(max_tokens=1),
                                     list(range(num_blocks)), 1)],
        chunks=[ScheduledChunk("profile", tokens, 0, [], True)],
    ))
    platform.synchronize(worker.device)
    peak = platform.max_memory_allocated(worker.device) - before
    del caches, runner
    platform.empty_cache()
    return max(peak, 0)
