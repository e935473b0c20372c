"""Admission: caps on how many sequences one request may ask for and how many may wait.

A request's sequences are its prompts times ``n``. One request over ``--max-sequences-per-request``
is a 400 (it can never be served); a request that would push the sequences waiting for a batch
slot past ``--max-queued-sequences`` is a 429 (retry later). Every admitted generator gives its
reservation back when it finishes, fails, is closed, or is dropped unstarted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from qwenserve.entrypoints.openai.errors import OpenAIError, bad_request

T = TypeVar("T")


class Admission:
    """Counts the sequences of unfinished requests; the running ones take batch slots first."""

    def __init__(self, max_per_request: int, max_queued: int, max_running: int) -> None:
        self.max_per_request = max_per_request
        self.max_queued = max_queued
        self.max_running = max_running
        self.in_flight = 0

    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.max_running)

    def check(self, num_seqs: int) -> None:
        """Raise the client's error if ``num_seqs`` more sequences may not be admitted now."""
        if num_seqs > self.max_per_request:
            raise bad_request(
                f"This request asks for {num_seqs} sequences (prompts x n); the server allows "
                f"at most {self.max_per_request} per request (--max-sequences-per-request)",
                "n",
            )
        room = self.max_running + self.max_queued - self.in_flight
        if num_seqs > room:
            raise OpenAIError(
                f"The server's queue is full: {self.queued} sequences are waiting and at most "
                f"{self.max_queued} may wait (--max-queued-sequences); retry later",
                429,
            )

    def admit(self, agen: AsyncIterator[T], num_seqs: int) -> AsyncIterator[T]:
        """``agen``, holding ``num_seqs`` sequences of the count until it is done with."""
        self.in_flight += num_seqs
        return _Admitted(self, agen, num_seqs)


class _Admitted(Generic[T]):
    """An engine generator that releases its reservation exactly once."""

    def __init__(self, admission: Admission, agen: AsyncIterator[T], num_seqs: int) -> None:
        self._admission = admission
        self._agen = agen
        self._num_seqs = num_seqs

    def _release(self) -> None:
        self._admission.in_flight -= self._num_seqs
        self._num_seqs = 0

    def __aiter__(self) -> _Admitted[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self._agen.__anext__()
        except BaseException:  # finished (StopAsyncIteration), failed or cancelled
            self._release()
            raise

    async def aclose(self) -> None:
        self._release()
        aclose = getattr(self._agen, "aclose", None)
        if aclose is not None:
            await aclose()

    def __del__(self) -> None:  # dropped without aclose (e.g. never started)
        self._release()
