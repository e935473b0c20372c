"""Prefix-cache keys: each full block is keyed by its parent block's key and its token ids.

    block 0: h0 = H(ROOT, t[0:16])     block 1: h1 = H(h0, t[16:32])    ...
A key therefore identifies the whole prefix up to the block's end, so one dict lookup per block
finds the longest cached prefix. blake2b makes accidental collisions negligible (a collision would
silently reuse the wrong KV, so Python's 64-bit ``hash`` is not enough).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

_ROOT = b"qwenserve-prefix-root"


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: list[int], block_size: int, num_tokens: int,
    extra_key: Callable[[int, int], bytes] | None = None,
) -> None:
    """Append hashes for every full block of ``token_ids[:num_tokens]`` not hashed yet.

    ``extra_key(start, end)`` adds what the token ids of a block do not show (the content
    hashes of the images among them, ``Request.block_extra_key``)."""
    num_full = num_tokens // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else None
        start, end = i * block_size, (i + 1) * block_size
        extra = extra_key(start, end) if extra_key is not None else b""
        block_hashes.append(hash_block(parent, token_ids[start:end], extra))
