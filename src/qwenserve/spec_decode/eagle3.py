"""EAGLE-3 proposer: a separate head drafts k tokens a step from the target's aux hidden states.

The same schedule as MTP (``mtp.py``: the catch-up over the positions the target kept, then
k - 1 single-token steps on the head's own output, its KV one more paged layer of the target's
cache that rolls back with ``num_computed_tokens``); what differs is what feeds the head and
what comes out of it:

    in:   the target's hidden states entering its aux layers (``DecoderModel.aux_hidden``,
          [T, 3 Ht], rows in the step's chunk order, as the final hidden states)
    out:  the head's pre-norm output (the next step's hidden); the draft is the argmax of its
          LM head over the draft vocabulary, mapped to a target id through ``d2t``

Drafts are argmaxes, which the rejection sampler accepts with probability p(d): lossless
whatever the head proposes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qwenserve.core.sched_output import ScheduledChunk
from qwenserve.layers.attention.base import AttentionBackend
from qwenserve.layers.caches import ModelCaches
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.models.dense import DecoderModel
from qwenserve.models.eagle3 import Eagle3Head
from qwenserve.spec_decode.mtp import MtpProposer
from qwenserve.spec_decode.proposer import RequestTokens


class Eagle3Proposer(MtpProposer):
    """``target``: the decoder whose ``aux_hidden`` the head reads (its ``aux_layer_ids``
    set)."""

    def __init__(self, head: Eagle3Head, target: DecoderModel, caches: ModelCaches,
                 attn_backend: AttentionBackend, block_size: int, device: torch.device,
                 num_tokens: int, max_model_len: int,
                 disable_by_batch_size: int | None = None) -> None:
        super().__init__(head, caches, attn_backend, block_size, device, num_tokens,
                         max_model_len, disable_by_batch_size)
        self.target = target

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                chunks: Sequence[ScheduledChunk] = ()) -> None:
        aux = self.target.aux_hidden
        assert aux is not None and hidden is not None and aux.shape[0] == hidden.shape[0], \
            "the EAGLE-3 head needs the target's aux hidden states of this step"
        self.target.aux_hidden = None
        super().forward(batch, aux, chunks)

    def choose(self, request_ids: list[str], rows: torch.Tensor, step: int,
               requests: Mapping[str, RequestTokens]) -> list[int]:
        draft = self.head.compute_logits(rows).argmax(-1)
        return self.head.to_target_ids(draft).tolist()
