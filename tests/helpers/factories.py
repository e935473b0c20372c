"""Small factories for pure-Python core tests (no torch)."""

from __future__ import annotations

import itertools

from qwenserve.config import SchedulerConfig
from qwenserve.core.cache.manager import CacheManager
from qwenserve.core.scheduler import Scheduler
from qwenserve.request import Request
from qwenserve.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(num_tokens: int = 10, max_tokens: int = 8, prompt: list[int] | None = None,
                 request_id: str | None = None, **params) -> Request:
    prompt = list(range(num_tokens)) if prompt is None else prompt
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(request_id or f"r{next(_ids)}", prompt, sp, max_tokens)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 32, max_model_len: int = 256,
                   enable_prefix_caching: bool = True, num_state_slots: int = 0) -> Scheduler:
    cache = CacheManager(num_blocks, block_size, enable_prefix_caching, num_state_slots)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len), cache)
