"""Cache memory plan: pure arithmetic shared by the engine and ``qwenserve plan``.

State slots come first (a fixed size per running sequence), KV blocks take the rest. The planner
and the engine call the same function, so their figures never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwenserve.core.cache.spec import CacheSpec, PagedKVSpec, RecurrentStateSpec

GIB = 1 << 30


@dataclass(frozen=True)
class CachePlan:
    """How a cache memory budget is split."""

    budget_bytes: int
    block_size: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    num_blocks: int
    num_state_slots: int  # 0 for models without recurrent layers

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_bytes_per_seq

    def max_concurrency(self, max_model_len: int) -> float:
        """How many sequences of ``max_model_len`` tokens fit at once (vLLM's log figure)."""
        per_seq_blocks = -(-max_model_len // self.block_size)
        by_kv = self.num_blocks / per_seq_blocks if per_seq_blocks else float("inf")
        if self.num_state_slots:
            return min(by_kv, float(self.num_state_slots - 1))
        return by_kv

    @property
    def max_running_seqs(self) -> int | None:
        """Sequences that can run at once given the state slots (None: not limited by state)."""
        return self.num_state_slots - 1 if self.num_state_slots else None

    def summary(self, max_model_len: int) -> str:
        return (
            f"KV cache: {self.kv_bytes_per_token} bytes/token, {self.num_blocks} blocks of "
            f"{self.block_size} tokens = {self.token_capacity:,} tokens "
            f"({self.kv_bytes / GIB:.2f} GiB); maximum concurrency for {max_model_len:,} tokens "
            f"per request: {self.max_concurrency(max_model_len):.2f}x"
            + (
                f"; recurrent state: {self.state_bytes_per_seq:,} bytes/sequence x "
                f"{self.num_state_slots} slots ({self.state_bytes / GIB:.2f} GiB, at most "
                f"{self.max_running_seqs} sequences running)"
                if self.num_state_slots
                else ""
            )
        )


class CacheTooSmallError(ValueError):
    """The budget cannot hold one sequence of ``max_model_len`` tokens."""


MAX_STATE_FRACTION = 0.5  # recurrent states may take at most half of the cache budget


def state_slots_for(per_seq: int, budget_bytes: int, max_num_seqs: int) -> int:
    """State slots to reserve: one per running sequence plus the null slot 0, at most
    MAX_STATE_FRACTION of the budget (fewer slots cap how many sequences run at once; the
    scheduler then keeps the rest waiting)."""
    if not per_seq:
        return 0
    fitting = int(budget_bytes * MAX_STATE_FRACTION // per_seq)
    if fitting < 2:
        raise CacheTooSmallError(
            f"The cache budget of {budget_bytes / GIB:.2f} GiB cannot hold the recurrent state of "
            f"even one sequence ({per_seq:,} bytes, at most {MAX_STATE_FRACTION:.0%} of the "
            "budget). Increase --kv-cache-memory-bytes / QWENSERVE_CPU_KVCACHE_SPACE or "
            "--gpu-memory-utilization, or use more devices (--tensor-parallel-size).")
    return min(max_num_seqs + 1, fitting)


def kv_bytes_per_token(specs: list[CacheSpec]) -> int:
    return sum(s.bytes_per_token for s in specs if isinstance(s, PagedKVSpec))


def state_bytes_per_seq(specs: list[CacheSpec]) -> int:
    return sum(s.bytes_per_seq for s in specs if isinstance(s, RecurrentStateSpec))


def accelerator_kv_budget(total_bytes: int, gpu_memory_utilization: float, weight_bytes: int,
                          activation_bytes: int, other_bytes: int = 0) -> int:
    """KV budget on a GPU/NPU, as vLLM sizes it: this process may use ``utilization x total``;
    its weights, its peak activations and what other processes (and the runtime) already hold
    come out of that, the KV cache gets the rest. May be <= 0 (nothing fits)."""
    return (int(total_bytes * gpu_memory_utilization) - weight_bytes - activation_bytes
            - other_bytes)


def plan_cache(
    specs: list[CacheSpec],
    budget_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> CachePlan:
    """Split ``budget_bytes`` into state slots and KV blocks; raise if one sequence cannot fit."""
    per_token = kv_bytes_per_token(specs)
    per_seq = state_bytes_per_seq(specs)
    num_slots = state_slots_for(per_seq, budget_bytes, max_num_seqs)
    remaining = budget_bytes - num_slots * per_seq
    num_blocks = remaining // (block_size * per_token) if per_token else 0
    plan = CachePlan(budget_bytes, block_size, per_token, per_seq, int(num_blocks), num_slots)
    if per_token and plan.token_capacity < max_model_len:
        need_gib = (-(-max_model_len // block_size) * block_size * per_token + num_slots * per_seq)
        raise CacheTooSmallError(
            f"KV cache of {plan.token_capacity:,} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len:,} tokens ({per_token:,} bytes/token; budget "
            f"{budget_bytes / GIB:.2f} GiB, needed at least {need_gib / GIB:.2f} GiB). Either "
            "increase --kv-cache-memory-bytes / QWENSERVE_CPU_KVCACHE_SPACE or "
            "--gpu-memory-utilization, or lower --max-model-len "
            f"(at most {plan.token_capacity:,} fits)."
        )
    return plan


def largest_max_model_len(specs: list[CacheSpec], budget_bytes: int, block_size: int,
                          max_num_seqs: int) -> int:
    """The longest sequence that fits the budget (``--max-model-len`` upper bound)."""
    per_token = kv_bytes_per_token(specs)
    per_seq = state_bytes_per_seq(specs)
    try:
        remaining = budget_bytes - state_slots_for(per_seq, budget_bytes, max_num_seqs) * per_seq
    except CacheTooSmallError:
        return 0
    if remaining <= 0:
        return 0
    if not per_token:
        return 1 << 62
    return int(remaining // (block_size * per_token)) * block_size
