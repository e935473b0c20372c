"""A request's ``kv_transfer_params`` (vLLM's field, set by the P/D proxy), in and out. No torch.

    proxy -> producer   {"do_remote_decode": true, ...}: prefill, keep the blocks, answer with
    producer -> proxy   {"do_remote_prefill": true, "remote_engine_id", "remote_host",
                         "remote_port", "remote_block_ids", "remote_request_id", "tp_size", ...}
    proxy -> consumer   the producer's answer, as is: pull those blocks, then decode
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELD = "kv_transfer_params"


@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer pulls a request's prompt KV from (the producer's answer)."""

    engine_id: str
    host: str
    port: int  # the producer's kv_port; its rank r serves on port + r
    block_ids: list[int]
    request_id: str  # the producer's id of the held request
    tp_size: int = 1
    block_size: int | None = None  # qwenserve producers say it; others may not
    num_tokens: int | None = None  # prompt tokens whose KV the blocks hold
    has_state: bool = False  # hybrid models: the recurrent state travels too


@dataclass(frozen=True)
class KVTransferParams:
    """``do_remote_decode``: this instance prefills and holds the KV for a consumer.
    ``remote``: this instance pulls the prompt's KV from a producer, then decodes."""

    do_remote_decode: bool = False
    remote: RemotePrefill | None = None


def parse_kv_transfer_params(value: object) -> KVTransferParams | None:
    """The request field -> params (None when it asks for nothing); ``ValueError`` naming the
    key otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{FIELD} must be an object, got {value!r}")
    decode, prefill = bool(value.get("do_remote_decode")), bool(value.get("do_remote_prefill"))
    if decode and prefill:
        raise ValueError(f"{FIELD}: do_remote_decode and do_remote_prefill cannot both be true")
    if not (decode or prefill):
        return None
    if decode:
        return KVTransferParams(do_remote_decode=True)
    missing = [k for k in ("remote_engine_id", "remote_host", "remote_port",
                           "remote_block_ids", "remote_request_id") if value.get(k) is None]
    if missing:
        raise ValueError(f"{FIELD}: do_remote_prefill needs {missing} (send the prefill "
                         "instance's kv_transfer_params answer unchanged)")
    block_ids = value["remote_block_ids"]
    if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
        raise ValueError(f"{FIELD}.remote_block_ids must be a list of block ids, "
                         f"got {block_ids!r}")
    return KVTransferParams(remote=RemotePrefill(
        engine_id=str(value["remote_engine_id"]), host=str(value["remote_host"]),
        port=_int(value, "remote_port"), block_ids=list(block_ids),
        request_id=str(value["remote_request_id"]), tp_size=_int(value, "tp_size", 1),
        block_size=_int(value, "remote_block_size", None),
        num_tokens=_int(value, "remote_num_tokens", None),
        has_state=bool(value.get("remote_has_state", False))))


def _int(value: Mapping[str, Any], key: str, default: int | None = 0) -> int | None:
    raw = value.get(key, default)
    if raw is None:
        return None
    try:
        return int(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{FIELD}.{key} must be an integer, got {raw!r}") from e


def producer_answer(engine_id: str, host: str, port: int, request_id: str,
                    block_ids: list[int], tp_size: int, block_size: int,
                    num_tokens: int, has_state: bool = False) -> dict[str, Any]:
    """What the producer returns with its one-token response, for the proxy to pass on."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": list(block_ids),
        "remote_request_id": request_id,
        "tp_size": tp_size,
        "remote_block_size": block_size,
        "remote_num_tokens": num_tokens,
        "remote_has_state": has_state,
    }
