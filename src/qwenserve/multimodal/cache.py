"""A least-recently-used cache bounded in bytes: processed images across requests
(``--mm-processor-cache-gb``, vLLM's default 4 GiB; 0 disables it).

A repeated image (a chat resending its history, many users sending the same picture) skips
resizing and normalizing. An item larger than the whole budget is not cached (vLLM serves it
uncached too). Queries and hits (in images) feed ``vllm:mm_cache_queries`` /
``vllm:mm_cache_hits``. The server's CPU pool processes several requests at once, so every
call holds one lock. No torch here: the caller says how big a value is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUBytesCache(Generic[V]):
    def __init__(self, capacity_bytes: int, size_of: Callable[[V], int]) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.size_of = size_of
        self.used_bytes = 0
        self.queries = 0
        self.hits = 0
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> V | None:
        with self._lock:
            self.queries += 1
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: V) -> bool:
        """Keep ``value`` (evicting the least recently used); False if it can never fit."""
        size = self.size_of(value)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._items:
                self.used_bytes -= self._items.pop(key)[1]
            while self.used_bytes + size > self.capacity_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self.used_bytes -= evicted
            self._items[key] = (value, size)
            self.used_bytes += size
            return True
