"""Client-side token counting: a local Hugging Face tokenizer, or the server's own tokenizer.

vLLM's benchmark always loads a tokenizer locally. We prefer that too (``--tokenizer PATH``, or
``--model`` when it names a local folder), but a load test must also run from a laptop that has
neither the model files nor ``transformers``: then we ask the server, through vLLM's
``POST /tokenize`` and ``POST /detokenize`` endpoints. ``transformers`` is imported only when a
local tokenizer is actually loaded.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import httpx
import numpy as np

from qwenserve.tools.bench.errors import BenchError, first_line

# Random prompts drawn through the server cannot see the vocabulary, so they cycle through the
# tokens of this text instead. Token contents do not change the cost of a forward pass; lengths
# (kept exact by re-tokenising through the server) and prefix sharing do.
_POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog while seven wizards quietly box jugs of milk. "
    "Engineers measure latency, throughput, memory, queues and tails before they size hardware; "
    "a careful benchmark warms up, sweeps the load, finds the knee and writes a short report. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536, symbols ( ) [ ] { } < > = + - * / % # @ ! ? "
    "Rivers, mountains, forests, deserts, islands, cities, harbours, bridges, towers and markets "
    "appear in stories about travel, trade, science, music, cooking, gardening and astronomy."
)


class TokenizerLike(Protocol):
    """What the datasets and the output-token counter need from a tokenizer."""

    name: str

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def num_special_tokens_to_add(self) -> int: ...

    def allowed_token_ids(self) -> np.ndarray: ...

    def random_token_ids(self, rng: Any, n: int) -> list[int]: ...


class HFTokenizer:
    """A ``transformers`` tokenizer, used exactly as vLLM's benchmark uses it."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tok = tokenizer
        self.name = name

    @classmethod
    def load(cls, path: str, mode: str = "auto", trust_remote_code: bool = False) -> HFTokenizer:
        """Load with ``AutoTokenizer`` (``mode`` as vLLM's ``--tokenizer-mode``), or raise a
        one-line ``BenchError``."""
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - depends on the client machine
            raise BenchError(f"--tokenizer needs the 'transformers' package: {e}") from e
        try:
            tok = AutoTokenizer.from_pretrained(
                path, use_fast=mode != "slow", trust_remote_code=trust_remote_code
            )
            return cls(tok, path)
        except Exception as e:
            raise BenchError(f"cannot load a tokenizer from {path!r}: {first_line(e)}") from e

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def num_special_tokens_to_add(self) -> int:
        return int(self._tok.num_special_tokens_to_add())

    @property
    def vocab_size(self) -> int:
        return int(self._tok.vocab_size)

    def allowed_token_ids(self) -> np.ndarray:
        """Every id below ``vocab_size`` except special tokens, as vLLM's random dataset."""
        special = set(self._tok.all_special_ids)
        return np.array([i for i in range(self.vocab_size) if i not in special])

    def random_token_ids(self, rng: Any, n: int) -> list[int]:
        """Ids in ``[0, vocab_size)``: vLLM's draw (``rng.integers`` or ``RandomState.randint``)."""
        draw = rng.integers if hasattr(rng, "integers") else rng.randint
        return [int(i) for i in draw(0, self.vocab_size, size=n)]


class ServerTokenizer:
    """The server's tokenizer over HTTP (vLLM's ``/tokenize`` and ``/detokenize``)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.name = f"{base_url}/tokenize"
        self._model = model
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=60.0)
        self._pool: np.ndarray | None = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._client.post(path, json={"model": self._model, **body})
        except httpx.HTTPError as e:
            raise BenchError(f"{self.name}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise BenchError(
                f"the server's {path} endpoint answered HTTP {response.status_code}; pass "
                "--tokenizer PATH (a Hugging Face tokenizer folder) to count tokens locally"
            )
        return response.json()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        return [int(t) for t in self._post("/tokenize", body)["tokens"]]

    def decode(self, token_ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": list(token_ids)})["prompt"])

    def num_special_tokens_to_add(self) -> int:
        return len(self.encode("", add_special_tokens=True))

    def allowed_token_ids(self) -> np.ndarray:
        """The distinct tokens of a fixed text: ids the server surely knows, none special."""
        if self._pool is None:
            self._pool = np.array(sorted(set(self.encode(_POOL_TEXT))))
        return self._pool

    def random_token_ids(self, rng: Any, n: int) -> list[int]:
        pool = self.allowed_token_ids()
        draw = rng.integers if hasattr(rng, "integers") else rng.randint
        return [int(pool[i]) for i in draw(0, len(pool), size=n)]

    def close(self) -> None:
        self._client.close()


def local_tokenizer_path(tokenizer: str | None, *folders: str | None) -> str | None:
    """``--tokenizer``, else the first of ``folders`` that is a local folder with a tokenizer.

    The folders tried are ``--model`` and the model's ``root`` from ``/v1/models`` (the server's
    model path, which is local when the benchmark runs on the server's machine).
    """
    if tokenizer:
        return tokenizer
    for folder in folders:
        if folder and os.path.isdir(folder) and _has_tokenizer_files(folder):
            return folder
    return None


def _has_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return any(os.path.exists(os.path.join(folder, n)) for n in names)
