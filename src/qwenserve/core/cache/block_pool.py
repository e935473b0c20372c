"""BlockPool: the KV blocks of every paged layer, with reference counts and an LRU prefix cache.

A block is either in use (ref_cnt > 0) or free. Free blocks sit in an LRU queue; a free block may
still hold a cached prefix (it has a hash) and can be revived by a prefix hit until it is evicted,
which happens when it reaches the front of the queue and is handed out for new tokens.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Allocation, sharing and eviction of ``num_blocks`` KV blocks (ids ``0..num_blocks-1``)."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Free blocks, least recently freed first. Values unused (OrderedDict as an ordered set).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks in use (0..1), as ``vllm:kv_cache_usage_perc``."""
        if not self.num_blocks:
            return 0.0
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached prefixes."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        block_ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Share cached blocks with one more request (reviving them if they were free)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference; blocks reaching zero join the tail of the free queue.

        Callers pass a request's blocks in reverse order so its last blocks are evicted first and
        its prefix, the part other requests are likely to share, survives longest.
        """
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full block under its prefix hash. False if another block holds it."""
        if not self.enable_caching or block_hash in self.cached:
            return False
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only allowed while no block is in use (as vLLM)."""
        if len(self.free_queue) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
