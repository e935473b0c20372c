"""Peak activation memory of one forward pass at the full token budget (accelerators only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.core.sched_output import NewRequestData, ScheduledChunk, SchedulerOutput
from qwenserve.sampling_params import SamplingParams
from qwenserve.worker.caches import allocate_caches
from qwenserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from qwenserve.worker.worker import Worker


def profile_peak_bytes(worker: Worker) -> int:
    """Run a prefill of ``max_num_batched_tokens`` tokens with a throwaway cache; return the
    peak bytes allocated beyond the weights."""
    cfg = worker.config
    num_tokens = min(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_model_len)
    block_size = cfg.cache.block_size
    num_blocks = -(-num_tokens // block_size)
    caches = allocate_caches(worker.specs, worker.model, num_blocks, block_size, 2,
                             worker.dtype, worker.device, zeroed=True)
    platform = worker.platform
    platform.synchronize(worker.device)
    platform.reset_peak_memory_stats(worker.device)
    before = platform.max_memory_allocated(worker.device)
    runner = ModelRunner(worker.model, caches, worker.backends, block_size, worker.device,
                         worker.tp.is_driver, 0, worker.has_state)
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
