"""SSE chunks with their constant fields encoded once are byte-identical to full encoding."""

from __future__ import annotations

from qwenserve.entrypoints.openai.streaming import ChunkEncoder, sse


def test_encoded_chunk_equals_full_encoding():
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m\u00e9"}
    enc = ChunkEncoder(head)
    for fields in ({"choices": [{"index": 0, "text": "h\u00e9\n\"x\"", "logprobs": None}]},
                   {"choices": [], "usage": {"prompt_tokens": 3}}, {"choices": []}):
        assert enc.encode(fields) == sse({**head, **fields})
