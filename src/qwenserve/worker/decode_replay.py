"""Decode steps replayed from a recording of their native kernel calls (CPU graph capture).

A decode-only step of a dense model runs, on CPU, nothing but native kernels: RMSNorm, the
GEMV/AMX GEMMs, rotary, paged attention, SiLU-and-mul. For a given number of sequences they are
the same calls on the same buffers every step; only the buffers' contents change. The first
such step of each batch size (two in a row, so sizes seen once are not recorded) runs eagerly
while ``native.recording`` keeps its calls, in buffers of its own (the embeddings, positions
and attention metadata: ``AttentionBackend.replay_metadata``). Later steps of that size copy
their inputs into those buffers and make the same calls, without the per-layer Python: a bf16
batch-1 step of the Qwen2.5-0.5B shape 35.7 -> 30.1 ms, 64 sequences 56.7 -> 51.8 ms on an
Emerald Rapids Xeon (docs/benchmarks.md). It is what vLLM does with CUDA graphs for decode batches
(``cudagraph_mode`` FULL_DECODE_ONLY), and ``--enforce-eager`` switches it off, as there.

A recording is only kept when it is complete: under a ``TorchDispatchMode`` every PyTorch op of
the step must be an allocation or a view (anything that computes would not be replayed), and
the tensors it allocated are kept alive for the replays. Models whose decode runs PyTorch ops
(MoE routing, tensor parallelism) simply keep running eagerly. What the check cannot see, and
the layers must keep true: a scalar a kernel is called with depends on the batch size only
(shapes, the block size), never on a step's data - per-step values travel in the buffers
(positions, slots, context lengths, block tables).

Vision-language checkpoints (Qwen3.5's published ones are ``...ForConditionalGeneration``)
replay their steps with no image rows, which are the text model's layers; a step whose requests
carry images (M-RoPE positions) runs eagerly. Hybrid models (Qwen3.5, Qwen3-Next) replay too:
their Gated DeltaNet layers are native kernels on the CPU backend, and their metadata has buffers
of its own (``RecurrentBackend.replay_metadata``). Their decode updates each sequence's recurrent
state in place, so a step that stopped midway cannot be run again: where a replay or a recording
of such a step fails after it began, the step fails (an error naming the kernel), rather than
advancing a state twice.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwenserve.layers.attention.base import AttentionBackend, AttentionMetadata
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.recurrent import GDNMetadata, RecurrentBackend
from qwenserve.logger import init_logger
from qwenserve.models.dense import DecoderModel, DenseForCausalLM
from qwenserve.models.vision_language import VisionLanguageMixin
from qwenserve.native.recording import NativeCall, record_calls, replay

logger = init_logger(__name__)

# PyTorch ops that only allocate or make views: a step that runs any other op is not recorded
_NO_COMPUTE = frozenset({
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten._reshape_alias.default", "aten.split_with_sizes.default", "aten.split.Tensor",
    "aten.slice.Tensor", "aten.select.int", "aten.alias.default", "aten.as_strided.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.t.default", "aten.detach.default",
    "aten.expand.default", "aten.permute.default", "aten.transpose.int", "aten.view.dtype",
})
_ALLOCATING = frozenset({"aten.empty.memory_format", "aten.empty_like.default",
                         "aten.empty_strided.default"})
# ops that compute unless they return their input itself (``x.to(x.dtype)``, a contiguous
# tensor's ``contiguous()``)
_NO_COMPUTE_IF_SAME = frozenset({"aten.to.dtype", "aten._to_copy.default",
                                 "aten.contiguous.default", "aten.clone.default"})


class _Allocations(TorchDispatchMode):
    """Lets a step run, keeping every tensor its ops return and naming the ops that compute."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []
        self.computing: set[str] = set()
        self.allocated_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name not in _NO_COMPUTE and not (
                name in _NO_COMPUTE_IF_SAME and args and out is args[0]):
            self.computing.add(name)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.tensors.append(t)
                if name in _ALLOCATING:
                    self.allocated_bytes += t.untyped_storage().nbytes()
        return out


@dataclass
class _Recording:
    """One batch size's recorded step: its input buffers, calls and output."""

    embeddings: torch.Tensor  # [n, hidden]
    positions: torch.Tensor  # [n]
    attn: AttentionMetadata
    state: GDNMetadata | None  # a hybrid model's recurrent-layer metadata
    calls: list[NativeCall]
    hidden: torch.Tensor  # [n, hidden], written by the calls
    buffers: list[torch.Tensor]  # every tensor the step allocated (the calls' pointers)
    nbytes: int


class DecodeReplays:
    """Recorded decode steps by batch size, least recently used dropped past ``max_bytes``."""

    def __init__(self, model: DenseForCausalLM, attn_backend: AttentionBackend,
                 recurrent_backend: RecurrentBackend, max_blocks_per_seq: int, max_batch: int,
                 max_bytes: int, sizes: tuple[int, ...] = ()) -> None:
        self.decoder: DecoderModel = model.model
        self.attn_backend = attn_backend
        self.recurrent_backend = recurrent_backend
        self.width = max_blocks_per_seq
        self.max_batch = max_batch
        # the batch sizes recorded (cudagraph_capture_sizes); empty: every size up to max_batch
        self.sizes = frozenset(sizes)
        self.max_bytes = max_bytes
        self._recordings: OrderedDict[int, _Recording] = OrderedDict()
        self._refused: set[int] = set()  # sizes whose step computes outside native kernels
        self._last_size = 0  # the previous decode-only step's batch size
        self.replayed_steps = 0  # for tests and benchmarks
        self._logged = False

    @staticmethod
    def applies_to(model: object) -> bool:
        """A causal LM whose forward is the embedding then ``run_layers``: the text models', and
        a vision-language model's in the steps with no image rows (``batch.mm`` None: the only
        ones ``forward`` records), where it merges nothing in between."""
        return (isinstance(model, DenseForCausalLM)
                and type(model).forward in (DenseForCausalLM.forward, VisionLanguageMixin.forward)
                and type(model.model).forward is DecoderModel.forward)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor | None:
        """The step's hidden states [n, hidden] from a replay or a new recording; None where
        the step is not one to record (the caller runs it eagerly)."""
        n = batch.input_ids.shape[0]
        if (batch.mm is not None or n > self.max_batch or n in self._refused
                or (self.sizes and n not in self.sizes)
                or self.decoder.aux_layer_ids or getattr(batch.attn, "num_decodes", 0) != n
                or (batch.state is not None and batch.state.num_decodes != n)):
            self._last_size = 0
            return None
        recorded = self._recordings.get(n)
        if recorded is not None:
            self._recordings.move_to_end(n)
            if self._refill(recorded, batch):
                recorded.embeddings.copy_(self.decoder.embed_tokens(batch.input_ids))
                recorded.positions.copy_(batch.positions)
                stopped = replay(recorded.calls)
                if stopped is None:
                    self.replayed_steps += 1
                    return recorded.hidden
                # a kernel refused this step's data: drop the recording; a dense step runs
                # eagerly (rewriting the same K/V the replay wrote before it stopped)
                del self._recordings[n]
                if recorded.state is not None:
                    fn = recorded.calls[stopped].fn
                    raise RuntimeError(
                        f"a replayed decode step of {n} sequences stopped at native call "
                        f"{stopped} ({getattr(fn, '__name__', fn)}), which refused this step's "
                        f"data; the recurrent state the calls before it advanced cannot be "
                        f"advanced again, so the step fails (--enforce-eager runs every step "
                        f"eagerly)")
            return None
        seen_before, self._last_size = self._last_size == n, n
        return self._record(n, batch, caches) if seen_before else None

    def _refill(self, recorded: _Recording, batch: ForwardBatch) -> bool:
        """This step's metadata into the recording's buffers; False where it does not fit."""
        if not self.attn_backend.refill(recorded.attn, batch.attn):
            return False
        if recorded.state is None or batch.state is None:
            return recorded.state is None and batch.state is None
        return self.recurrent_backend.refill(recorded.state, batch.state)

    def _record(self, n: int, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor | None:
        kv_cache = next(iter(caches.kv.values()), None)  # one dtype and layout for all layers
        attn = None if kv_cache is None else self.attn_backend.replay_metadata(
            batch.attn, self.width, kv_cache)
        if attn is None:
            self._refuse(n, f"the {self.attn_backend.name} attention backend does not replay "
                            f"decodes of this KV cache")
            return None
        state = None
        if batch.state is not None:
            state = self.recurrent_backend.replay_metadata(batch.state)
            if state is None:
                self._refuse(n, f"the {self.recurrent_backend.name} recurrent backend has no "
                                f"replay")
                return None
        embeddings = self.decoder.embed_tokens(batch.input_ids).clone()
        positions = batch.positions.clone()
        inputs = dataclasses.replace(batch, positions=positions, attn=attn, state=state)
        allocations = _Allocations()
        try:
            with record_calls() as calls, allocations:
                hidden = self.decoder.run_layers(embeddings, positions, inputs, caches)
        except Exception as e:
            if state is not None:  # its layers before the error advanced the recurrent state
                self._refuse(n, f"{type(e).__name__}: {e}")
                raise
            # e.g. a PyTorch path reading metadata it lacks: the eager run that follows
            # rewrites whatever K/V this one wrote, to the same values
            self._refuse(n, f"{type(e).__name__}: {e}")
            return None
        if allocations.computing:
            # the step ran eagerly all the same: its result stands, it is just not replayable
            self._refuse(n, ", ".join(sorted(allocations.computing)) + " outside the kernels")
            return hidden
        nbytes = allocations.allocated_bytes + embeddings.nbytes + positions.nbytes
        if nbytes > self.max_bytes:
            self._refuse(n, f"its buffers ({nbytes >> 20} MiB) pass the recordings' budget")
            return hidden
        self._recordings[n] = _Recording(embeddings, positions, attn, state, calls, hidden,
                                         allocations.tensors, nbytes)
        # once at INFO (operators see that it acts and how to turn it off), then at DEBUG
        (logger.debug if self._logged else logger.info)(
            "recorded the decode step of %d sequence(s): %d native calls, %.1f MiB of buffers; "
            "later decode steps of that size replay them (--enforce-eager: every step eager)",
            n, len(calls), nbytes / 2**20)
        self._logged = True
        while sum(r.nbytes for r in self._recordings.values()) > self.max_bytes:
            self._recordings.popitem(last=False)
        return hidden

    def _refuse(self, n: int, why: str) -> None:
        self._refused.add(n)
        logger.debug("decode steps of %d sequences run eagerly: %s", n, why)
