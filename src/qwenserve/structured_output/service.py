"""GrammarService: compiles grammars on a small thread pool, off the engine thread, and keeps
the results (or the compile error) by spec, so a schema many requests share compiles once.

One service per (tokenizer, vocabulary) in a process: the server's API side, the engine and the
driver worker find the same one, so a grammar the API checked is already compiled when the
engine schedules the request and the worker builds its matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from qwenserve.logger import init_logger
from qwenserve.structured_output.backend import CompiledGrammar, GrammarBackend
from qwenserve.structured_output.params import GrammarSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)

MAX_CACHED_GRAMMARS = 256
_SERVICES: dict[tuple, GrammarService] = {}
_SERVICES_LOCK = threading.Lock()


class GrammarService:
    def __init__(self, backend: GrammarBackend, max_workers: int = 2,
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="qwenserve-grammar")
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._max_cached = max_cached

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compiled grammar (a future; raises ``GrammarError`` from ``result()``)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self.backend.compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking form of ``submit`` (offline use and the worker's fallback)."""
        return self.submit(spec).result()


def grammar_service(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int],
                    key: str) -> GrammarService:
    """The process's service for this tokenizer (``key`` names it: the tokenizer's path)."""
    ident = (key, vocab_size, tuple(sorted(stop_token_ids)))
    with _SERVICES_LOCK:
        service = _SERVICES.get(ident)
        if service is None:
            from qwenserve.structured_output.xgrammar_backend import XgrammarBackend

            backend = XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
            service = _SERVICES[ident] = GrammarService(backend)
            logger.info("Structured outputs: %s backend ready (vocabulary %d)", backend.name,
                        vocab_size)
        return service


def model_grammar_service(model_config: Any, tokenizer: PreTrainedTokenizerBase | None = None) -> GrammarService:
    """The service for a model (its tokenizer is loaded unless given)."""
    key = str(model_config.tokenizer)
    stop_ids = list(model_config.eos_token_ids)
    ident = (key, int(model_config.vocab_size), tuple(sorted(stop_ids)))
    if tokenizer is None and ident not in _SERVICES:
        from qwenserve.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_config)
    return grammar_service(tokenizer, int(model_config.vocab_size), stop_ids, key)
