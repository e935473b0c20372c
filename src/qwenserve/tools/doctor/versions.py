"""Version strings as Ascend and PyPI write them: ``8.3.RC2``, ``25.0.rc1.1``, ``2.10.0.post4``.

PEP 440 parsing rejects half of these, so comparison uses a small key of its own: numbers compare as
numbers, pre-release words (rc, alpha, beta, dev, T) sort before any number at the same place and
``post`` sorts after, which puts ``8.3.RC2`` before ``8.3.0`` and ``2.10.0`` before
``2.10.0.post4``.
"""

from __future__ import annotations

import functools
import re

_PRE_RELEASE = {"dev", "a", "alpha", "b", "beta", "t", "rc"}


def version_key(text: str) -> tuple[tuple[int, int | str], ...]:
    tokens = re.findall(r"\d+|[A-Za-z]+", text.split("+", 1)[0])
    key: list[tuple[int, int | str]] = []
    for token in tokens:
        if token.isdigit():
            key.append((1, int(token)))
        elif token.lower() in _PRE_RELEASE:
            key.append((0, token.lower()))
        else:  # post, spc, hotfix letters: after the release they follow
            key.append((2, token.lower()))
    return tuple(key)


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, the same as, or newer than ``b``.

    The shorter key is padded with zeros, so ``9.1 == 9.1.0``, ``8.3.RC2 < 8.3.0`` and
    ``2.7.1.dev2025 < 2.7.1 < 2.7.1.post1``.
    """
    ka, kb = version_key(a), version_key(b)
    width = max(len(ka), len(kb))
    ka += ((1, 0),) * (width - len(ka))
    kb += ((1, 0),) * (width - len(kb))
    return (ka > kb) - (ka < kb)


sort_key = functools.cmp_to_key(compare)


def base_version(text: str) -> str:
    """``2.10.0.post4`` -> ``2.10.0``; ``2.13.0+cpu`` -> ``2.13.0``: the release torch_npu
    pairs on."""
    match = re.match(r"\d+(?:\.\d+){0,2}", text.strip())
    return match.group(0) if match else text.strip()


def in_range(version: str, minimum: str, maximum_exclusive: str) -> bool:
    return compare(version, minimum) >= 0 and compare(version, maximum_exclusive) < 0
