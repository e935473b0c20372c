"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``).

No weights and no device: it costs one vectorised scan of the token history per request, so it
works on every architecture, and pays off where the output copies the prompt (edits, quoting,
code refactors).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None
                ) -> list[int]:
        """Up to ``min(num_tokens, max_tokens)`` draft tokens, or [] when no n-gram recurs."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        tokens = np.asarray(token_ids)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows start at i in [0, length - n - 1]: each is followed by at least one token.
            windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence
                return tokens[start : start + k].tolist()
        return []
