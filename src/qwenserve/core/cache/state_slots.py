"""StateSlotManager: one fixed-size recurrent-state slot per live sequence (Gated DeltaNet layers).

Slot 0 is the null slot (padding rows point at it); slots 1..num_slots-1 are handed out. A slot is
taken at a request's first allocation and returned on finish, abort or preemption (preemption is
by recompute, so the state is rebuilt from scratch when the request resumes).
"""

from __future__ import annotations


class StateSlotManager:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, 0, -1))  # pop() hands out 1, 2, ...
        self.req_to_slot: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def get(self, request_id: str) -> int | None:
        return self.req_to_slot.get(request_id)

    def acquire(self, request_id: str) -> int | None:
        """The request's slot, assigning one if it has none; None when all are taken."""
        slot = self.req_to_slot.get(request_id)
        if slot is None:
            if not self.free_slots:
                return None
            slot = self.free_slots.pop()
            self.req_to_slot[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def usage(self) -> float:
        usable = self.num_slots - 1
        return len(self.req_to_slot) / usable if usable > 0 else 0.0
