"""StateSlotManager: recurrent-state slots (Gated DeltaNet layers): one per live sequence, and
prefix-cache checkpoints in the idle ones.

Slot 0 is the null slot (padding rows point at it); slots 1..num_slots-1 are handed out. A live
slot is taken at a request's first allocation and returned on finish, abort or preemption.

A recurrent state cannot be rebuilt from KV blocks, so prefix caching on hybrid models keeps
*checkpoints*: copies of a sequence's state right after a block boundary, keyed by that block's
prefix hash. They live in idle slots, like cached KV blocks in free blocks: idle slots form an LRU
queue, a slot handed out to a request (or taken for a newer checkpoint) loses its checkpoint, and
the number of sequences that can run at once is unchanged.

    idle queue (evicted first -> last):  [3: empty] [5: ckpt h7] [2: ckpt h9]
    acquire("r") -> slot 3;  save(h11) -> slot 5 (h7 evicted);  lookup(h9) -> slot 2
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlotManager:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Idle slots in eviction order (OrderedDict as an ordered set).
        self.idle: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_slots))
        self.req_to_slot: dict[str, int] = {}
        self.checkpoints: dict[bytes, int] = {}  # block hash -> slot
        self.checkpoint_hash: dict[int, bytes] = {}  # slot -> block hash

    @property
    def num_free_slots(self) -> int:
        return len(self.idle)

    def get(self, request_id: str) -> int | None:
        return self.req_to_slot.get(request_id)

    def acquire(self, request_id: str, keep: int | None = None) -> int | None:
        """The request's slot, assigning one if it has none; None when all are taken. ``keep``
        (a checkpoint about to be restored into this request) is not handed out."""
        slot = self.req_to_slot.get(request_id)
        if slot is not None:
            return slot
        candidates = (s for s in self.idle if s != keep)
        slot = next(candidates, None)
        if slot is None:
            return None
        del self.idle[slot]
        self._forget_checkpoint(slot)
        self.req_to_slot[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Return a live slot; its state is mid-sequence, worth nothing, so it is reused first."""
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self.idle[slot] = None
            self.idle.move_to_end(slot, last=False)

    # ---- checkpoints --------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self.checkpoints.get(block_hash)

    def touch(self, slot: int) -> None:
        """A checkpoint was used: evict it last."""
        if slot in self.idle:
            self.idle.move_to_end(slot)

    def reserve_checkpoint(self, block_hash: bytes, exclude: set[int] = frozenset()) -> int | None:
        """An idle slot to copy a state into, registered under ``block_hash`` (the least recently
        used idle slot outside ``exclude``, evicting its checkpoint). None when the hash is
        already saved or no slot is free for it. The copy must happen before the next step is
        scheduled; ``exclude`` holds the slots this step already copies into."""
        if block_hash in self.checkpoints:
            return None
        slot = next((s for s in self.idle if s not in exclude), None)
        if slot is None:
            return None
        self._forget_checkpoint(slot)
        self.checkpoints[block_hash] = slot
        self.checkpoint_hash[slot] = block_hash
        self.idle.move_to_end(slot)
        return slot

    def reset(self) -> None:
        """Forget every checkpoint (``/reset_prefix_cache``)."""
        self.checkpoints.clear()
        self.checkpoint_hash.clear()

    def _forget_checkpoint(self, slot: int) -> None:
        block_hash = self.checkpoint_hash.pop(slot, None)
        if block_hash is not None:
            del self.checkpoints[block_hash]

    def usage(self) -> float:
        usable = self.num_slots - 1
        return len(self.req_to_slot) / usable if usable > 0 else 0.0
