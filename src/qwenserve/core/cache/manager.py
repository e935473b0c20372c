"""CacheManager: the one face the scheduler sees of the paged KV blocks and the state slots.

Per request it keeps the block table (block ids in position order) and how many of its blocks are
registered in the prefix cache. Token position ``p`` of a request lives in

    block_ids[p // block_size], offset p % block_size
    e.g. block_size 4, block_ids [7, 2, 9]:  positions 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9

Hybrid models (recurrent state slots) hit a cached prefix only up to a block boundary where a
state checkpoint was saved (``state_slots.py``): the KV blocks come from the pool as usual, the
state is copied from the checkpoint into the request's slot before its first chunk runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwenserve.core.cache.block_pool import BlockPool
from qwenserve.core.cache.hashing import extend_block_hashes
from qwenserve.core.cache.state_slots import StateSlotManager
from qwenserve.request import Request


@dataclass
class PrefixCacheStats:
    """Token counts for ``vllm:prefix_cache_queries_total`` / ``_hits_total``."""

    queries: int = 0
    hits: int = 0


class CacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, self.enable_prefix_caching)
        self.state_slots = StateSlotManager(num_state_slots) if num_state_slots else None
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # ---- lookup -------------------------------------------------------------------------------
    def lookup_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of ``req`` (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        tokens = req.all_token_ids
        extend_block_hashes(req.block_hashes, tokens, self.block_size, len(tokens),
                            req.block_extra_key)
        max_blocks = (len(tokens) - 1) // self.block_size
        hit: list[int] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        if self.state_slots is not None:  # only as deep as the deepest state checkpoint
            while hit and self.state_slots.lookup(req.block_hashes[len(hit) - 1]) is None:
                hit.pop()
        return hit

    def checkpoint_slot(self, req: Request, num_hit_blocks: int) -> int | None:
        """The state checkpoint a prefix hit of ``num_hit_blocks`` blocks restores (hybrid)."""
        if self.state_slots is None or not num_hit_blocks:
            return None
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                            num_hit_blocks * self.block_size, req.block_extra_key)
        return self.state_slots.lookup(req.block_hashes[num_hit_blocks - 1])

    def restore_state(self, req: Request, checkpoint_slot: int) -> tuple[int, int]:
        """(checkpoint slot, the request's slot): the copy the workers make before the step."""
        assert self.state_slots is not None
        self.state_slots.touch(checkpoint_slot)
        return checkpoint_slot, self.state_slots.get(req.request_id)

    def checkpoint_position(self, req: Request) -> int | None:
        """Where a hybrid model's prefill should stop once to leave a state checkpoint: the last
        block boundary before the request's last known token (a follow-up that extends this
        prompt, e.g. the next turn of a chat, then skips all of it but the tail). None when
        there is nothing to save."""
        if not self.enable_prefix_caching or self.state_slots is None:
            return None
        position = (req.num_tokens - 1) // self.block_size * self.block_size
        if position <= req.num_computed_tokens:
            return None
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, position,
                            req.block_extra_key)
        if self.state_slots.lookup(req.block_hashes[position // self.block_size - 1]) is not None:
            return None
        return position

    def save_state(self, req: Request, num_tokens: int,
                   taken: set[int] = frozenset()) -> tuple[int, int] | None:
        """(the request's slot, a checkpoint slot) when its state after ``num_tokens`` tokens (a
        block boundary) should be kept for prefix hits; None otherwise. Called once the step's
        allocations are done, so no request of this step is handed the checkpoint slot;
        ``taken``: checkpoint slots this step already saves into."""
        if (not self.enable_prefix_caching or self.state_slots is None
                or num_tokens % self.block_size or not num_tokens):
            return None
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, num_tokens,
                            req.block_extra_key)
        block_hash = req.block_hashes[num_tokens // self.block_size - 1]
        slot = self.state_slots.reserve_checkpoint(block_hash, exclude=taken)
        return None if slot is None else (self.state_slots.get(req.request_id), slot)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------------
    def allocate(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None,
        keep_slot: int | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` (a prefix hit, new requests only) are shared, not copied; so is the
        state checkpoint ``keep_slot`` it restores, which is therefore not handed out as the
        request's own slot. Returns the block ids appended to the request's table (hit blocks
        first), or None when there is not enough room, in which case nothing changed.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(req.request_id, [])
        num_tokens = (
            req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = -(-num_tokens // self.block_size) - len(blocks) - len(computed_blocks)
        # Hit blocks that are free still count in the free queue but are not available for reuse.
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_revived:
            return None
        if (self.state_slots is not None
                and self.state_slots.acquire(req.request_id, keep=keep_slot) is None):
            return None
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(max(num_needed, 0))
        if req.request_id not in self.req_blocks:
            self.req_blocks[req.request_id] = []
            self.num_cached_blocks[req.request_id] = len(computed_blocks)
        self.req_blocks[req.request_id].extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks[req.request_id]
        if num_full <= start:
            return
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                            num_full * self.block_size, req.block_extra_key)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks (last block first) and its state slot."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])
        if self.state_slots is not None:
            self.state_slots.release(req.request_id)

    # ---- queries ------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def state_slot(self, request_id: str) -> int | None:
        return self.state_slots.get(request_id) if self.state_slots is not None else None

    def usage(self) -> float:
        """KV usage 0..1 (state-slot usage for models without paged layers)."""
        if self.pool.num_blocks == 0 and self.state_slots is not None:
            return self.state_slots.usage()
        return self.pool.usage()

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.state_slots is not None:
            self.state_slots.reset()
        return True
