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

The checkpoint rules live here too, behind the ``CacheManager`` facade:

- ``plan_checkpoint``: a prefill chunk that runs past the request's *checkpoint position* (the
  last block boundary before its last known token) reserves an idle slot, and the step's
  Gated DeltaNet kernels write the state there as they pass that position, mid-chunk
  (``ScheduledChunk.state_checkpoint``); a follow-up that extends the prompt (a chat's next
  turn) then skips all of it but the tail. The reserved slot leaves the idle queue until the
  step is done (``after_compute`` registers it), and goes back unregistered if the request is
  preempted or finished first, or if a live request needs it (live requests outrank
  checkpoints). Until 2026-12 the prefill stopped at that position instead, which cost one
  extra small step per prompt (~0.7% of an offline Qwen3.5 run, docs/benchmarks.md).
- ``after_compute``: a prefill chunk that ended on a block boundary reserves a checkpoint slot;
  the copy (live slot -> checkpoint) goes out with the next step's allocation, and the workers
  make it before that step's forward pass, when the live slot still holds that state. Copies
  run saves first, then restores, so a restore may read a checkpoint saved the same step.
- ``trim_hit`` / ``checkpoint_for`` / ``restore``: a prefix hit only reaches as deep as a
  checkpoint, whose state is copied into the request's own slot before its first chunk runs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from qwenserve.core.cache.hashing import extend_block_hashes
from qwenserve.request import Request

Copy = tuple[int, int]  # (source slot, destination slot)


@dataclass
class PlannedCheckpoint:
    """A state the step's kernels save mid-prefill: after ``position`` tokens, into ``slot``."""

    position: int
    slot: int
    block_hash: bytes  # registered under it after the step


class NoStateSlots:
    """The state-slot manager of a model without recurrent layers: nothing to hold or save."""

    def trim_hit(self, req: Request, hit: list[int]) -> list[int]:
        return hit

    def checkpoint_for(self, req: Request, num_hit_blocks: int) -> int | None:
        return None

    def plan_checkpoint(self, req: Request, start: int, num_new: int,
                        keep: int | None = None) -> None:
        """Nothing to checkpoint."""

    def planned(self, request_id: str) -> PlannedCheckpoint | None:
        return None

    def acquire(self, request_id: str, keep: int | None = None) -> bool:
        return True

    def get(self, request_id: str) -> int | None:
        return None

    def restore(self, request_id: str, checkpoint: int) -> Copy:
        raise AssertionError("no recurrent state to restore")

    def after_compute(self, req: Request, num_step_tokens: int) -> None:
        """Nothing to checkpoint."""

    def drain_saves(self) -> list[Copy]:
        return []

    def release(self, request_id: str) -> None:
        """No slot to return."""

    def reset(self) -> None:
        """No checkpoints to forget."""

    def usage(self) -> float:
        return 0.0


class StateSlotManager:
    def __init__(self, num_slots: int, block_size: int = 16,
                 enable_prefix_caching: bool = False) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_saves: list[Copy] = []  # reserved, not yet handed to the workers
        # Idle slots in eviction order (OrderedDict as an ordered set).
        self.idle: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_slots))
        self.req_to_slot: dict[str, int] = {}
        self.checkpoints: dict[bytes, int] = {}  # block hash -> slot
        self.checkpoint_hash: dict[int, bytes] = {}  # slot -> block hash
        # this step's mid-prefill checkpoints by request; their slots are out of the idle queue
        self.planned_checkpoints: dict[str, PlannedCheckpoint] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self.idle)

    def get(self, request_id: str) -> int | None:
        return self.req_to_slot.get(request_id)

    def acquire(self, request_id: str, keep: int | None = None) -> bool:
        """Give the request a slot if it has none; False when all are taken. ``keep`` (a
        checkpoint about to be restored into this request) is not handed out."""
        if request_id in self.req_to_slot:
            return True
        slot = next((s for s in self.idle if s != keep), None)
        if slot is not None:
            del self.idle[slot]
        elif self.planned_checkpoints:  # a live request outranks a checkpoint not written yet
            slot = self.planned_checkpoints.popitem()[1].slot  # out of the idle queue already
        else:
            return False
        self._forget_checkpoint(slot)
        # A live request outranks a checkpoint not copied yet: drop that save.
        self.pending_saves = [c for c in self.pending_saves if c[1] != slot]
        self.req_to_slot[request_id] = slot
        return True

    def release(self, request_id: str) -> None:
        """Return a live slot, and the slot of a checkpoint planned for this step: their states
        are mid-sequence (or not written yet), worth nothing, so they are reused first."""
        planned = self.planned_checkpoints.pop(request_id, None)
        for slot in (self.req_to_slot.pop(request_id, None),
                     None if planned is None else planned.slot):
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
        already saved or no slot is free for it. The copy must happen before the next forward
        pass; ``exclude`` holds the slots that copies not made yet read or write."""
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
        self.pending_saves.clear()

    def _forget_checkpoint(self, slot: int) -> None:
        block_hash = self.checkpoint_hash.pop(slot, None)
        if block_hash is not None:
            del self.checkpoints[block_hash]

    def usage(self) -> float:
        usable = self.num_slots - 1
        return len(self.req_to_slot) / usable if usable > 0 else 0.0

    # ---- checkpoint rules (hybrid prefix caching) -------------------------------------------
    def _hash_at(self, req: Request, num_tokens: int) -> bytes:
        """The prefix hash of the block that ends at ``num_tokens`` (a block boundary)."""
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, num_tokens,
                            req.block_extra_key)
        return req.block_hashes[num_tokens // self.block_size - 1]

    def trim_hit(self, req: Request, hit: list[int]) -> list[int]:
        """A KV prefix hit, cut back to the deepest block with a state checkpoint at its end."""
        while hit and self.lookup(req.block_hashes[len(hit) - 1]) is None:
            hit = hit[:-1]
        return hit

    def checkpoint_for(self, req: Request, num_hit_blocks: int) -> int | None:
        """The checkpoint a prefix hit of ``num_hit_blocks`` blocks restores."""
        if not num_hit_blocks:
            return None
        return self.lookup(self._hash_at(req, num_hit_blocks * self.block_size))

    def checkpoint_position(self, req: Request) -> int | None:
        """Where the request's prefill leaves a checkpoint (the last block boundary before its
        last known token); None when there is nothing new to save."""
        if not self.enable_prefix_caching:
            return None
        position = (req.num_tokens - 1) // self.block_size * self.block_size
        if position <= req.num_computed_tokens or self.lookup(self._hash_at(req, position)):
            return None
        return position

    def plan_checkpoint(self, req: Request, start: int, num_new: int,
                        keep: int | None = None) -> None:
        """A prefill chunk of ``num_new`` tokens from ``start`` that runs past the request's
        checkpoint position: reserve an idle slot (not ``keep``, a checkpoint this request
        restores) for the state the kernels save there."""
        position = self.checkpoint_position(req) if num_new > 1 else None
        if position is None or not start < position < start + num_new:
            return
        busy = {s for copy in self.pending_saves for s in copy}
        slot = next((s for s in self.idle if s not in busy and s != keep), None)
        if slot is None:
            return
        del self.idle[slot]
        self._forget_checkpoint(slot)
        self.planned_checkpoints[req.request_id] = PlannedCheckpoint(
            position, slot, self._hash_at(req, position))

    def planned(self, request_id: str) -> PlannedCheckpoint | None:
        return self.planned_checkpoints.get(request_id)

    def restore(self, request_id: str, checkpoint: int) -> Copy:
        """(checkpoint, the request's slot): the copy the workers make before the step."""
        self.touch(checkpoint)
        return checkpoint, self.req_to_slot[request_id]

    def after_compute(self, req: Request, num_step_tokens: int) -> None:
        """Register the checkpoint the step saved mid-prefill, if any; reserve one when a
        prefill chunk (``num_step_tokens`` > 1) ended on a block boundary, whose copy goes out
        with the next allocation (``drain_saves``)."""
        planned = self.planned_checkpoints.pop(req.request_id, None)
        if planned is not None:
            self.idle[planned.slot] = None  # most recently used: evicted last
            if planned.block_hash in self.checkpoints:  # two requests saved it this step
                self.idle.move_to_end(planned.slot, last=False)
            else:
                self.checkpoints[planned.block_hash] = planned.slot
                self.checkpoint_hash[planned.slot] = planned.block_hash
        end, slot = req.num_computed_tokens, self.req_to_slot.get(req.request_id)
        if (not self.enable_prefix_caching or num_step_tokens <= 1 or not end
                or end % self.block_size or slot is None):
            return
        busy = {s for copy in self.pending_saves for s in copy}  # sources may be idle by now
        checkpoint = self.reserve_checkpoint(self._hash_at(req, end), exclude=busy)
        if checkpoint is not None:
            self.pending_saves.append((slot, checkpoint))

    def drain_saves(self) -> list[Copy]:
        saves, self.pending_saves = self.pending_saves, []
        return saves
