"""DPRouter: which data-parallel engine a new request goes to (pure Python, no torch).

    load(e) = requests in flight on e (sent, not finished: exact, kept here)
            + 3 x requests waiting in e's scheduler (its last step's report: a queue means that
              engine is saturated, so it counts more than a running request)
            + e's KV-cache usage (0..1: breaks ties towards the emptier cache)

A request whose prompt starts with a prefix an engine has seen recently goes to that engine, so
its prefix cache hits, unless that engine's load exceeds the least loaded one's by more than
``affinity_slack``. Prefixes are remembered by the prefix cache's own block keys
(``core/cache/hashing.py``: a key names the whole prefix up to its block's end) for the first
``affinity_blocks`` full blocks of each prompt, in a bounded LRU map.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from qwenserve.core.cache.hashing import extend_block_hashes

WAITING_WEIGHT = 3


@dataclass
class _Engine:
    in_flight: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def load(self) -> float:
        return self.in_flight + WAITING_WEIGHT * self.num_waiting + self.kv_cache_usage


class DPRouter:
    def __init__(self, engine_indexes: tuple[int, ...], block_size: int,
                 prefix_affinity: bool = True, affinity_blocks: int = 8,
                 affinity_slack: float = 4.0, max_prefixes: int = 65536) -> None:
        if not engine_indexes:
            raise ValueError("a data-parallel router needs at least one engine")
        self._engines = {i: _Engine() for i in engine_indexes}
        self._owner: dict[str, int] = {}  # request id -> engine index
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity
        self.affinity_blocks = affinity_blocks
        self.affinity_slack = affinity_slack
        self.max_prefixes = max_prefixes
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()  # block key -> engine index

    # ---- decisions --------------------------------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """The engine for a new request; counts it in flight there until ``finished``."""
        keys = self._prefix_keys(prompt_token_ids)
        least = min(self._engines, key=lambda i: (self._engines[i].load, i))
        chosen = least
        holder = self._holder(keys)
        if holder is not None and (self._engines[holder].load
                                   <= self._engines[least].load + self.affinity_slack):
            chosen = holder
        for key in keys:
            self._prefixes[key] = chosen
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)
        self._owner[request_id] = chosen
        self._engines[chosen].in_flight += 1
        return chosen

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def finished(self, request_id: str) -> None:
        """The request ended (finished, refused or aborted): no longer in flight."""
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._engines[index].in_flight -= 1

    def report(self, engine_index: int, num_waiting: int, kv_cache_usage: float) -> None:
        """An engine's gauges at the end of its last step."""
        engine = self._engines.get(engine_index)
        if engine is not None:
            engine.num_waiting = num_waiting
            engine.kv_cache_usage = kv_cache_usage

    def load(self, engine_index: int) -> float:
        return self._engines[engine_index].load

    def in_flight(self, engine_index: int) -> int:
        return self._engines[engine_index].in_flight

    # ---- prefixes ---------------------------------------------------------------------------
    def _prefix_keys(self, prompt_token_ids: list[int]) -> list[bytes]:
        if not self.prefix_affinity:
            return []
        keys: list[bytes] = []
        num_tokens = min(len(prompt_token_ids), self.affinity_blocks * self.block_size)
        extend_block_hashes(keys, prompt_token_ids, self.block_size, num_tokens)
        return keys

    def _holder(self, keys: list[bytes]) -> int | None:
        """The engine that saw the longest of these prefixes last."""
        for key in reversed(keys):
            index = self._prefixes.get(key)
            if index is not None:
                return index
        return None
