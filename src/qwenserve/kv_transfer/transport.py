"""Paged KV blocks as raw bytes over ZeroMQ/TCP: the producer's block server and the
consumer's pull. Works wherever torch and TCP do (CPU, CUDA, Ascend NPU).

    consumer (DEALER)                                producer (ROUTER, kv_ip:kv_port + rank)
    {"request_id", "engine_id", "block_ids",  --->   the request is held? gather its blocks
     "heads", "expect"}                              (only those local KV heads, when given)
                                              <---   {"ok", "block_size", "layers": [...]},
                                                     then one frame per attention layer:
                                                     K|V of those blocks, [2, n * bs, Hkv, D]
                                                     (hybrid models: then the held state
                                                     slot's conv and SSM state per layer)

A producer rank releases a hold after ``expect`` pulls (several consumer ranks pull from it when
the two sides run different tensor-parallel sizes: ``heads.py``).

A pull for a request the producer has not registered yet (its hold reaches the workers one
step after the answer left) waits there up to ``PENDING_S`` before it is refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from qwenserve.layers.caches import ModelCaches
from qwenserve.logger import init_logger

logger = init_logger(__name__)

PENDING_S = 10.0  # how long an unknown request id may wait for its hold to be registered
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def block_slots(block_ids: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """KV slot indices of whole blocks, in order: block b -> b*bs .. b*bs + bs - 1."""
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return (blocks[:, None] * block_size
            + torch.arange(block_size, device=device)).flatten()  # [n * bs]


@dataclass
class _Pending:
    identity: bytes
    header: dict
    deadline: float


class KVBlockServer:
    """Serves held requests' blocks of this rank's KV cache, on a thread of its own."""

    def __init__(self, caches: ModelCaches, block_size: int, engine_id: str,
                 address: str, on_sent: Callable[[str], None]) -> None:
        self.caches, self.block_size, self.engine_id = caches, block_size, engine_id
        self.on_sent = on_sent
        self.holds: dict[str, tuple[list[int], int | None]] = {}  # -> blocks, state slot
        self._pulls: dict[str, int] = {}  # pulls served so far, per held request
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise RuntimeError(f"--kv-transfer-config: cannot serve KV blocks on {address} "
                               f"({e}); choose a free kv_port / kv_ip") from e
        self._stop = threading.Event()
        self._pending: list[_Pending] = []
        self._thread = threading.Thread(target=self._run, name="qwenserve-kv-server",
                                        daemon=True)
        self._thread.start()

    def hold(self, request_id: str, block_ids: list[int], state_slot: int | None) -> None:
        with self._lock:
            self.holds[request_id] = (list(block_ids), state_slot)

    def release(self, request_id: str) -> None:
        with self._lock:
            self.holds.pop(request_id, None)
            self._pulls.pop(request_id, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(20):
                self._receive()
            self._serve_pending()

    def _receive(self) -> None:
        frames = self._sock.recv_multipart()
        identity = frames[0]
        try:
            header = json.loads(frames[-1]) if len(frames) == 3 else None
        except ValueError:
            header = None
        if not isinstance(header, dict):  # not a consumer of ours: answered, never fatal
            self._send_error(identity, "malformed pull request")
            return
        self._pending.append(_Pending(identity, header, time.monotonic() + PENDING_S))

    def _serve_pending(self) -> None:
        still = []
        for p in self._pending:
            request_id = str(p.header.get("request_id"))
            with self._lock:
                held = self.holds.get(request_id)
            if held is not None:
                self._serve(p.identity, p.header, request_id, held)
            elif time.monotonic() > p.deadline:
                self._send_error(p.identity, f"the producer (engine_id {self.engine_id}) holds "
                                 f"no KV for request {request_id}: it was pulled already, "
                                 "timed out (QWENSERVE_KV_HOLD_TIMEOUT_S), or never ran here")
            else:
                still.append(p)
        self._pending = still

    def _serve(self, identity: bytes, header: dict, request_id: str,
               hold: tuple[list[int], int | None]) -> None:
        held, state_slot = hold
        wanted = header.get("block_ids")
        engine_id = header.get("engine_id")
        if engine_id is not None and str(engine_id) != self.engine_id:
            return self._send_error(identity, f"this producer is engine_id {self.engine_id}, "
                                    f"not {engine_id}")
        if not isinstance(wanted, list) or wanted != held[: len(wanted)] or not wanted:
            return self._send_error(identity, f"block ids {wanted} are not request "
                                    f"{request_id}'s blocks {held}")
        heads = header.get("heads")
        try:
            frames, layers = self._gather(wanted, heads)
            states = _gather_state(self.caches, state_slot if heads is None else None, frames)
        except Exception as e:  # noqa: BLE001 - told to the consumer, the server lives on
            logger.exception("Serving KV of request %s failed", request_id)
            return self._send_error(identity, f"the producer failed to read the blocks: {e}")
        meta = {"ok": True, "block_size": self.block_size, "layers": layers, "states": states}
        self._sock.send_multipart([identity, b"", json.dumps(meta).encode(), *frames])
        with self._lock:
            self._pulls[request_id] = self._pulls.get(request_id, 0) + 1
            done = self._pulls[request_id] >= int(header.get("expect") or 1)
        if done:
            self.release(request_id)
            self.on_sent(request_id)
        return None

    def _gather(self, block_ids: list[int], heads: list[int] | None
                ) -> tuple[list[bytes], list[dict]]:
        frames, layers = [], []
        if heads == []:  # a release-only ping: nothing to send
            return frames, layers
        slots = index = None
        for layer_id, kv in sorted(self.caches.kv.items()):
            if slots is None:
                slots = block_slots(block_ids, self.block_size, kv.device)
                index = None if heads is None else torch.tensor(heads, device=kv.device)
            data = kv.index_select(1, slots)  # [2, n * bs, Hkv, D]
            if index is not None:
                data = data.index_select(2, index)  # [2, n * bs, len(heads), D]
            data = data.cpu().contiguous()
            frames.append(data.view(torch.uint8).numpy().tobytes())
            layers.append({"layer_id": layer_id, "dtype": str(data.dtype),
                           "shape": list(data.shape)})
        return frames, layers

    def _send_error(self, identity: bytes, message: str) -> None:
        self._sock.send_multipart([identity, b"", json.dumps({"ok": False,
                                                               "error": message}).encode()])


def _gather_state(caches: ModelCaches, slot: int | None, frames: list[bytes]) -> list[dict]:
    """Append the held state slot's conv and SSM state of every Gated DeltaNet layer."""
    out = []
    for layer_id, state in (sorted(caches.state.items()) if slot is not None else []):
        entry = {"layer_id": layer_id}
        for name, pool in (("conv", state.conv), ("ssm", state.ssm)):
            data = pool[slot].cpu().contiguous()
            frames.append(data.view(torch.uint8).numpy().tobytes())
            entry[name] = {"dtype": str(data.dtype), "shape": list(data.shape)}
        out.append(entry)
    return out


def pull_blocks(ctx: zmq.Context, address: str, request: dict, caches: ModelCaches,
                block_ids: list[int], block_size: int, timeout_s: float,
                state_slot: int | None = None, dst_heads: list[int] | None = None) -> None:
    """Fetch a request's blocks (and, hybrid models, its state into ``state_slot``) from the
    producer at ``address``; ``RuntimeError`` saying what went wrong."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart([b"", json.dumps(request).encode()])
        if not sock.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"no answer from the producer at {address} within "
                               f"{timeout_s:g} s (is the prefill instance running, and its "
                               "kv_port reachable from here?)")
        _, raw, *frames = sock.recv_multipart()
    finally:
        sock.close()
    meta = json.loads(raw)
    if not meta.get("ok"):
        raise RuntimeError(f"the producer at {address} refused: {meta.get('error')}")
    kv_frames = frames[: len(meta["layers"])]
    if dst_heads == []:  # a release-only ping
        return
    _write(meta, kv_frames, caches.kv, block_ids, block_size, dst_heads)
    _write_state(meta.get("states") or [], frames[len(kv_frames):], caches, state_slot)


def _write_state(states: list[dict], frames: list[bytes], caches: ModelCaches,
                 slot: int | None) -> None:
    if slot is None:
        return
    if sorted(s["layer_id"] for s in states) != sorted(caches.state):
        raise RuntimeError("the producer sent no recurrent state for this hybrid model's "
                           "Gated DeltaNet layers (same model on both sides?)")
    it = iter(frames)
    for entry in states:
        state = caches.state[entry["layer_id"]]
        for name, pool in (("conv", state.conv), ("ssm", state.ssm)):
            meta, shape = entry[name], list(pool.shape[1:])
            if meta["shape"] != shape or meta["dtype"] != str(pool.dtype):
                raise RuntimeError(f"the producer's {name} state of layer {entry['layer_id']} "
                                   f"is {meta['dtype']} {meta['shape']}, this server needs "
                                   f"{pool.dtype} {shape}: same model, --dtype, "
                                   "--mamba-ssm-cache-dtype and -tp on both sides")
            data = torch.frombuffer(bytearray(next(it)), dtype=_DTYPES[meta["dtype"]])
            pool[slot].copy_(data.view(shape).to(pool.device))


def _write(meta: dict, frames: list[bytes], kv: dict[int, torch.Tensor], block_ids: list[int],
           block_size: int, dst_heads: list[int] | None) -> None:
    layers = meta["layers"]
    if meta["block_size"] != block_size or sorted(x["layer_id"] for x in layers) != sorted(kv):
        raise RuntimeError("the producer's KV layout (block size or attention layers) differs "
                           "from this server's: run the same model with the same --block-size")
    slots = None
    for layer, frame in zip(layers, frames, strict=True):
        cache = kv[layer["layer_id"]]
        num_heads = cache.shape[2] if dst_heads is None else len(dst_heads)
        shape = [2, len(block_ids) * block_size, num_heads, cache.shape[3]]
        if layer["shape"] != shape or layer["dtype"] != str(cache.dtype):
            raise RuntimeError(f"the producer's KV of layer {layer['layer_id']} is "
                               f"{layer['dtype']} {layer['shape']}, this server needs "
                               f"{cache.dtype} {shape}: same model, --dtype and "
                               "--tensor-parallel-size on both sides")
        data = torch.frombuffer(bytearray(frame), dtype=_DTYPES[layer["dtype"]]).view(shape)
        if slots is None:
            slots = block_slots(block_ids, block_size, cache.device)
        data = data.to(cache.device)
        if dst_heads is None:
            cache.index_copy_(1, slots, data)
            continue
        for i, head in enumerate(dst_heads):  # a view of the cache: written in place
            cache[:, :, head].index_copy_(1, slots, data[:, :, i])
