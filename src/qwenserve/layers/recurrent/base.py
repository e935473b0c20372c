"""The recurrent-state (Gated DeltaNet) kernel seam: per-step metadata and the backend interface.

A step packs every scheduled request "varlen": the new tokens of all requests are concatenated
into one ``[num_tokens, ...]`` tensor, and ``query_start_loc`` marks each request's span. Each
request owns one state slot in the per-layer state pools; ``has_initial_state`` says whether that slot
already holds the state after the request's computed tokens (chunked-prefill continuation or
decode) or must be read as zeros (a fresh request: the slot may hold a previous owner's leftovers).
Never pad inside a request: a padded step still decays the state and shifts the conv window.

State pools, per Gated DeltaNet layer (allocated by the cache layer, indexed by ``state_slots``):

    conv_state  [num_state_slots, K-1, conv_dim]  model dtype  the last K-1 raw (pre-conv)
                                                             inputs, oldest row first
                                                             (vLLM's "SD" layout)
    ssm_state   [num_state_slots, Hv, Dk, Dv]     float32      S of  o_t = S_t^T q_t
                                                             (HF's layout)

Hybrid prefix caching (``GDNMetadata.checkpoints``): a prefill may also leave its states after
its first n tokens in another slot, written as the kernels pass that point (the scheduler's
``ScheduledChunk.state_checkpoint``), so that its prefill need not stop there for a copy.

Token-major conv rows make the state update "keep the last K-1 rows" with no transpose. The ssm
state keeps HF's layout so HF caches and references compare without a transpose; vLLM's Triton
kernels use the transpose ``[Hv, Dv, Dk]`` (a backend with such a kernel may transpose its pool).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from qwenserve.layers.recurrent.gated_norm import rms_norm_gated
from qwenserve.layers.recurrent.gating import gdn_gating

DEFAULT_CHUNK_SIZE = 64  # HF and fla (Triton) use 64


@dataclass(frozen=True)
class StateCheckpoint:
    """A request's states after its first ``num_tokens`` tokens this step (0 < num_tokens < its
    token count) are saved into ``slot`` too; ``first_row``, ``live_slot`` and
    ``has_initial_state`` repeat its layout for the conv's history."""

    first_row: int
    num_tokens: int
    live_slot: int
    has_initial_state: bool
    slot: int

    def pad(self, chunk_size: int) -> int:
        """Rows the reference's chunk layout skips after the checkpoint, up to a chunk
        boundary."""
        return -self.num_tokens % chunk_size


@dataclass(frozen=True)
class GDNMetadata:
    """Per-step index tensors shared by every Gated DeltaNet layer; built once by the model runner.

    Requests with one new token (decodes) take the vectorised recurrent step; requests with more
    (prefills and prefill chunks) take the chunked kernel. Each prefill is padded at its end to
    whole chunks of C tokens. Prefills are sorted by chunk count, longest first, and the chunks
    laid out step-major, so the chunks that scan step i processes are one contiguous block (the
    i-th chunk of each of the first ``active_per_step[i]`` prefills):

        packed tokens   | d0 | p1 (5 tokens) | d2 | p3 (150 tokens) |     C = 64
        sorted prefills   p3 (3 chunks), p1 (1 chunk)          active_per_step = (2, 1, 1)
        chunk layout    | p3.0  p1.0 | p3.1 | p3.2 |           chunk of (prefill p, step i)
                          step 0       step 1 step 2             = sum(active_per_step[:i]) + p
        prefill_padded_pos[j] = chunk * C + position in chunk, for the j-th prefill token
                                (p3.2 holds 22 tokens + 42 pad rows, p1.0 5 + 59)

    A prefill with a state checkpoint after n tokens has pad rows after its n-th token up to
    the chunk boundary, so that a scan step ends there (``checkpoint_steps``); a pad row (zero
    k, v, beta and log decay) leaves the state as it is. The native kernels read
    ``prefill_checkpoint_lens`` / ``_slots`` instead (0: none) and split their chunks there.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    state_slots: torch.Tensor  # [num_reqs] int64
    has_initial_state: torch.Tensor  # [num_reqs] bool
    decode_tokens: torch.Tensor  # [num_decodes] int64, packed row of each 1-token request
    decode_slots: torch.Tensor  # [num_decodes] int64
    decode_has_init: torch.Tensor  # [num_decodes] bool
    prefill_slots: torch.Tensor  # [num_prefills] int64, sorted order
    prefill_has_init: torch.Tensor  # [num_prefills] bool, sorted order
    prefill_starts: torch.Tensor  # [num_prefills] int64, first packed row, sorted order
    prefill_lens: torch.Tensor  # [num_prefills] int64, tokens, sorted order
    prefill_tokens: torch.Tensor  # [num_prefill_tokens] int64, packed rows
    prefill_padded_pos: torch.Tensor  # [num_prefill_tokens] int64, rows in the chunk layout
    chunk_token: torch.Tensor  # [num_chunks * C] int64, packed row feeding each chunk row
    chunk_pad_pos: torch.Tensor  # [num_pad] int64, chunk rows that are padding (zeroed)
    prefill_checkpoint_lens: torch.Tensor  # [num_prefills] int64, n of its checkpoint or 0
    prefill_checkpoint_slots: torch.Tensor  # [num_prefills] int64, its slot (0: none)
    active_per_step: tuple[int, ...]  # prefills still running at chunk-scan step i
    num_chunks: int
    chunk_size: int
    checkpoints: tuple[StateCheckpoint, ...] = ()  # batch order
    checkpoint_steps: tuple[tuple[int, int, int], ...] = ()  # (scan step, sorted prefill, slot)

    @property
    def num_decodes(self) -> int:
        return self.decode_tokens.numel()

    @property
    def num_prefills(self) -> int:
        return self.prefill_slots.numel()


def _tensors(meta: GDNMetadata) -> dict[str, torch.Tensor]:
    """The per-step tensors of ``meta`` by field name (the rest are Python values fixed by the
    step's layout)."""
    return {f.name: v for f in fields(meta) if isinstance(v := getattr(meta, f.name), torch.Tensor)}


def static_copy(meta: GDNMetadata) -> GDNMetadata:
    """``meta`` with every tensor in a buffer of its own (a recorded step's metadata)."""
    return replace(meta, **{name: t.clone() for name, t in _tensors(meta).items()})


def _host_list(values: Sequence[int] | Sequence[bool] | torch.Tensor) -> list:
    """Host copy of a small index list; pass CPU data to avoid a device sync per step."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass(frozen=True)
class _PrefillLayout:
    active_per_step: list[int]
    tokens: list[int]  # packed row of each prefill token, sorted-prefill order
    padded_pos: list[int]  # its row in the chunk layout
    chunk_token: list[int]  # packed row feeding each chunk-layout row (0 for padding)
    pad_pos: list[int]  # chunk-layout rows that are padding
    checkpoint_steps: list[tuple[int, int, int]]  # (scan step ending there, prefill, slot)


def _prefill_layout(
    qsl: list[int], prefills: list[int], chunks: dict[int, int], chunk_size: int,
    saves: dict[int, StateCheckpoint],
) -> _PrefillLayout:
    """Place the sorted prefills' tokens in the step-major chunk layout (see ``GDNMetadata``);
    ``saves``: the checkpoints by request, whose prefills are padded to a chunk boundary
    after their n-th token."""
    steps = max(chunks.values(), default=0)
    active = [sum(1 for i in prefills if chunks[i] > s) for s in range(steps)]
    step_first = [sum(active[:s]) for s in range(steps)]  # first chunk of each scan step
    tokens, padded, checkpoint_steps = [], [], []
    for p, i in enumerate(prefills):
        tokens.extend(range(qsl[i], qsl[i + 1]))
        cut, pad = qsl[i + 1] - qsl[i], 0  # no checkpoint: no rows skipped
        if i in saves:
            cut, pad = saves[i].num_tokens, saves[i].pad(chunk_size)
            checkpoint_steps.append(((cut + pad) // chunk_size - 1, p, saves[i].slot))
        for t in range(qsl[i + 1] - qsl[i]):
            u = t + pad if t >= cut else t
            padded.append((step_first[u // chunk_size] + p) * chunk_size + u % chunk_size)
    chunk_token = [-1] * (sum(active) * chunk_size)
    for token, pos in zip(tokens, padded, strict=True):
        chunk_token[pos] = token
    pad_pos = [pos for pos, token in enumerate(chunk_token) if token < 0]
    chunk_token = [max(token, 0) for token in chunk_token]
    return _PrefillLayout(active, tokens, padded, chunk_token, pad_pos, checkpoint_steps)


def _checkpoints(
    qsl: list[int], slots: list[int], init: list[bool],
    requested: Sequence[tuple[int, int] | None] | None,
) -> dict[int, StateCheckpoint]:
    """The step's ``(n, slot)`` checkpoint requests (batch order, None: none), checked."""
    out = {}
    for i, request in enumerate(requested or ()):
        if request is None:
            continue
        n, slot = request
        if not 0 < n < qsl[i + 1] - qsl[i]:
            raise ValueError(f"a state checkpoint after {n} tokens of request {i}, which runs "
                             f"{qsl[i + 1] - qsl[i]} this step (1 .. {qsl[i + 1] - qsl[i] - 1} "
                             "allowed)")
        out[i] = StateCheckpoint(qsl[i], n, slots[i], bool(init[i]), slot)
    return out


def build_gdn_metadata(
    query_start_loc: Sequence[int] | torch.Tensor,
    state_slots: Sequence[int] | torch.Tensor,
    has_initial_state: Sequence[bool] | torch.Tensor,
    device: torch.device | str = "cpu",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    checkpoints: Sequence[tuple[int, int] | None] | None = None,
) -> GDNMetadata:
    """Turn the step's host-side request layout into the index tensors the kernels need;
    ``checkpoints``: per request, ``(n, slot)`` to save its states after n tokens, or None."""
    qsl, slots, init = (_host_list(v) for v in (query_start_loc, state_slots, has_initial_state))
    lens = [qsl[i + 1] - qsl[i] for i in range(len(slots))]
    saves = _checkpoints(qsl, slots, init, checkpoints)
    decodes = [i for i, n in enumerate(lens) if n == 1]
    chunks = {i: -(-(n + (saves[i].pad(chunk_size) if i in saves else 0)) // chunk_size)
              for i, n in enumerate(lens) if n > 1}
    prefills = sorted(chunks, key=lambda i: -chunks[i])  # stable: ties keep batch order
    layout = _prefill_layout(qsl, prefills, chunks, chunk_size, saves)

    def ints(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def flags(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.bool, device=device)

    return GDNMetadata(
        query_start_loc=ints(qsl),
        state_slots=ints(slots),
        has_initial_state=flags(init),
        decode_tokens=ints([qsl[i] for i in decodes]),
        decode_slots=ints([slots[i] for i in decodes]),
        decode_has_init=flags([init[i] for i in decodes]),
        prefill_slots=ints([slots[i] for i in prefills]),
        prefill_has_init=flags([init[i] for i in prefills]),
        prefill_starts=ints([qsl[i] for i in prefills]),
        prefill_lens=ints([lens[i] for i in prefills]),
        prefill_tokens=ints(layout.tokens),
        prefill_padded_pos=ints(layout.padded_pos),
        chunk_token=ints(layout.chunk_token),
        chunk_pad_pos=ints(layout.pad_pos),
        prefill_checkpoint_lens=ints([saves[i].num_tokens if i in saves else 0
                                      for i in prefills]),
        prefill_checkpoint_slots=ints([saves[i].slot if i in saves else 0 for i in prefills]),
        active_per_step=tuple(layout.active_per_step),
        num_chunks=sum(layout.active_per_step),
        chunk_size=chunk_size,
        checkpoints=tuple(saves.values()),
        checkpoint_steps=tuple(layout.checkpoint_steps),
    )


class RecurrentBackend(ABC):
    """Seam: one platform's Gated DeltaNet kernels. ``torch_ref`` is the CPU path and the oracle.

    Both methods read the initial state of request ``i`` from ``pool[state_slots[i]]`` when
    ``has_initial_state[i]`` (zeros otherwise) and write the final state back to the same slot.
    """

    name: str = "base"
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def build_metadata(
        self,
        query_start_loc: Sequence[int] | torch.Tensor,
        state_slots: Sequence[int] | torch.Tensor,
        has_initial_state: Sequence[bool] | torch.Tensor,
        device: torch.device | str,
        checkpoints: Sequence[tuple[int, int] | None] | None = None,
    ) -> GDNMetadata:
        """Once per step, shared by all Gated DeltaNet layers; pass host (CPU) index data.
        ``checkpoints``: per request, ``(n, slot)`` (its states after n tokens also go to
        ``slot``; both kernels must honour them) or None."""
        return build_gdn_metadata(
            query_start_loc, state_slots, has_initial_state, device, self.chunk_size, checkpoints
        )

    def replay_metadata(self, meta: GDNMetadata) -> GDNMetadata | None:
        """For a decode-only step's ``meta``: the same metadata in buffers of its own, that
        ``refill`` loads any later decode-only step of as many sequences into (a recorded decode
        step reads them there: worker/decode_replay.py). None where this backend's decode is not
        native calls on such buffers (the default)."""
        return None

    def refill(self, static: GDNMetadata, meta: GDNMetadata) -> bool:
        """Copy ``meta`` into ``static`` (``replay_metadata``'s); False where it does not fit
        (another number of sequences, prefill rows)."""
        if meta.num_prefills or static.num_prefills or meta.num_decodes != static.num_decodes:
            return False
        for name, t in _tensors(meta).items():
            getattr(static, name).copy_(t)
        return True

    @abstractmethod
    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        meta: GDNMetadata,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """Depthwise causal conv over each request: x [num_tokens, conv_dim] -> same shape."""

    @abstractmethod
    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: GDNMetadata,
    ) -> torch.Tensor:
        """q, k [num_tokens, Hk, Dk], v [num_tokens, Hv, Dv], g, beta [num_tokens, Hv] ->
        o [num_tokens, Hv, Dv] (q/k l2-normalised inside, q scaled by Dk**-0.5)."""

    def gating(
        self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) [num_tokens, Hv] float32 from the a/b projections [num_tokens, Hv] (may be
        strided views): g the log decay, beta = sigmoid(b) with b's rounding (the kernels read
        it in float32). The reference; a backend may fuse it."""
        g, beta = gdn_gating(a, b, A_log, dt_bias)
        return g, beta.float()

    def gated_rms_norm(
        self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The layer's closing ``w * rmsnorm(x) * silu(gate)`` per head: x, gate
        [num_tokens, Hv, Dv] (gate may be a strided view), weight [Dv] -> x's shape and dtype.
        The reference; a backend may fuse it."""
        return rms_norm_gated(x, gate, weight, eps)
