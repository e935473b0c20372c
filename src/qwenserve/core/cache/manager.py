"""CacheManager: the one face the scheduler sees of the cache, over one manager per kind.

    CacheManager (facade)  lookup_prefix, allocate, cache_full_blocks, free, usage
      PagedKVManager       paged.py        block tables over the shared BlockPool (attention)
      StateSlotManager     state_slots.py  recurrent-state slots and their prefix checkpoints
                           (NoStateSlots for models without recurrent layers)

``allocate()`` answers with everything the step needs from the cache: the request's new blocks,
its state slot, and the state copies the workers make before the forward pass; a hybrid
prefill's mid-chunk checkpoint is read back with ``planned_checkpoint`` once the step is
scheduled (a live request admitted later in the same step may take its slot). A new cache
policy (an MTP draft's KV, a sliding window) is a new per-kind manager file plugged in here, not
a branch in the scheduler (docs/structure.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwenserve.core.cache.paged import PagedKVManager
from qwenserve.core.cache.state_slots import (
    Copy,
    NoStateSlots,
    PlannedCheckpoint,
    StateSlotManager,
)
from qwenserve.request import Request


@dataclass
class PrefixCacheStats:
    """Token counts for ``vllm:prefix_cache_queries_total`` / ``_hits_total``."""

    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class PrefixHit:
    """A new request's cached prefix: shared KV blocks and, on hybrid models, the state
    checkpoint saved at their end."""

    block_ids: list[int]
    num_tokens: int
    checkpoint_slot: int | None = None


NO_HIT = PrefixHit([], 0)


@dataclass
class Allocation:
    new_block_ids: list[int]  # appended to the request's block table (a hit's blocks first)
    num_tokens: int  # the asked tokens (all of them run this step)
    state_slot: int | None  # the request's recurrent-state slot (hybrid models)
    state_saves: list[Copy] = field(default_factory=list)  # live -> checkpoint, before forward
    state_restores: list[Copy] = field(default_factory=list)  # checkpoint -> live, after saves


class CacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_state_slots: int = 0, num_lookahead_tokens: int = 0,
                 max_model_len: int | None = None) -> None:
        self.block_size = block_size
        # MTP drafting writes the head's KV up to this many positions past a step's tokens:
        # their slots are allocated with the step's (never past max_model_len).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.kv = PagedKVManager(num_blocks, block_size, enable_prefix_caching)
        self.states: StateSlotManager | NoStateSlots = (
            StateSlotManager(num_state_slots, block_size, enable_prefix_caching)
            if num_state_slots else NoStateSlots())
        self.stats = PrefixCacheStats()
        self._step_tokens: dict[str, int] = {}  # tokens each request runs this step

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The longest cached prefix of ``req`` (at least one token left to compute)."""
        hit = self.states.trim_hit(req, self.kv.lookup(req))
        return PrefixHit(hit, len(hit) * self.block_size,
                         self.states.checkpoint_for(req, len(hit)))

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                 exact: bool = False) -> Allocation | None:
        """Make room for ``num_new_tokens`` tokens after the computed ones (and after the
        prefix ``hit`` of a request being admitted, whose blocks and checkpoint are shared, not
        copied); ``exact``: a P/D pull fills them (no forward pass, so no state checkpoint).
        None when there is no room, in which case nothing changed."""
        start = req.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        computed = hit.block_ids if hit is not None else []
        checkpoint = hit.checkpoint_slot if hit is not None else None
        end = start + num_new_tokens
        if self.num_lookahead_tokens:
            end = max(end, min(end + self.num_lookahead_tokens, self.max_model_len or end))
        num_missing = self.kv.num_missing(req, end, computed)
        if num_missing is None or not self.states.acquire(req.request_id, keep=checkpoint):
            return None
        out = Allocation(self.kv.allocate(req, computed, num_missing), num_new_tokens,
                         self.states.get(req.request_id), self.states.drain_saves())
        if hit is not None:
            self.stats.queries += req.num_tokens
            self.stats.hits += hit.num_tokens
        if checkpoint is not None:
            out.state_restores.append(self.states.restore(req.request_id, checkpoint))
        if not exact:
            self.states.plan_checkpoint(req, start, num_new_tokens, keep=checkpoint)
        self._step_tokens[req.request_id] = num_new_tokens
        return out

    def cache_full_blocks(self, req: Request) -> None:
        """After the step computed ``req``'s tokens: register its newly full blocks in the prefix
        cache, and checkpoint its state where a prefill chunk ended on a block boundary."""
        self.kv.cache_full_blocks(req)
        self.states.after_compute(req, self._step_tokens.pop(req.request_id, 0))

    def planned_checkpoint(self, request_id: str) -> PlannedCheckpoint | None:
        """The state checkpoint this step's kernels save mid-prefill for the request, if any
        (ask once the step is scheduled)."""
        return self.states.planned(request_id)

    def free(self, req: Request) -> None:
        """Release the request's blocks and its state slot."""
        self.kv.free(req.request_id)
        self.states.release(req.request_id)
        self._step_tokens.pop(req.request_id, None)

    @property
    def has_states(self) -> bool:
        return isinstance(self.states, StateSlotManager)

    def hold_state(self, request_id: str) -> int | None:
        """P/D producer: a slot, kept apart from live requests, for a copy of ``request_id``'s
        state that a consumer pulls (None: every slot is taken)."""
        key = f"{request_id}/kv-transfer"
        return self.states.get(key) if self.states.acquire(key) else None

    def release_held_state(self, request_id: str) -> None:
        self.states.release(f"{request_id}/kv-transfer")

    def usage(self) -> float:
        """KV usage 0..1 (state-slot usage for models without paged layers)."""
        if self.kv.pool.num_blocks == 0:
            return self.states.usage()
        return self.kv.pool.usage()

    # ---- for the engine and the tests --------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    def state_slot(self, request_id: str) -> int | None:
        return self.states.get(request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.kv.pool.reset_prefix_cache():
            return False
        self.states.reset()
        return True
