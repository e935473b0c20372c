"""PagedKVManager: the block table of each request over the shared BlockPool (attention layers).

Token position ``p`` of a request lives in

    block_ids[p // block_size], offset p % block_size
    e.g. block_size 4, block_ids [7, 2, 9]:  positions 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9

Full blocks are registered in the pool's prefix cache under their prefix hash (``hashing.py``), so
a later request with the same prefix shares them instead of recomputing.
"""

from __future__ import annotations

from qwenserve.core.cache.block_pool import BlockPool
from qwenserve.core.cache.hashing import extend_block_hashes
from qwenserve.request import Request


class PagedKVManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks registered in the prefix cache

    def lookup(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of ``req`` (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        tokens = req.all_token_ids
        extend_block_hashes(req.block_hashes, tokens, self.block_size, len(tokens),
                            req.block_extra_key)
        hit: list[int] = []
        for block_hash in req.block_hashes[: (len(tokens) - 1) // self.block_size]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def num_missing(self, req: Request, num_tokens: int, computed_blocks: list[int]) -> int | None:
        """Blocks to take from the pool so ``req`` holds ``num_tokens`` tokens (``computed_blocks``
        shared first); None when the pool has not that many free."""
        have = len(self.req_blocks.get(req.request_id, [])) + len(computed_blocks)
        num_needed = max(-(-num_tokens // self.block_size) - have, 0)
        # Hit blocks that are free still count in the free queue but are not available for reuse.
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        return None if num_needed > self.pool.num_free_blocks - num_revived else num_needed

    def allocate(self, req: Request, computed_blocks: list[int], num_new_blocks: int) -> list[int]:
        """Append the shared ``computed_blocks`` and ``num_new_blocks`` fresh ones (checked with
        ``num_missing`` first); returns the appended ids."""
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(num_new_blocks)
        if req.request_id not in self.req_blocks:
            self.req_blocks[req.request_id] = []
            self.num_cached_blocks[req.request_id] = len(computed_blocks)
        self.req_blocks[req.request_id].extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache."""
        blocks = self.req_blocks.get(req.request_id)
        if not self.enable_prefix_caching or not blocks:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks[req.request_id]
        if num_full <= start:
            return
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                            num_full * self.block_size,
                            req.block_extra_key)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (evicted first)."""
        blocks = self.req_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])
