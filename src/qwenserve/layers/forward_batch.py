"""ForwardBatch: everything one forward pass needs, passed to the model as an argument.

It lives beside the layers that read it (the worker builds it, the models consume it), so models
never import the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qwenserve.layers.attention.base import AttentionMetadata
from qwenserve.layers.recurrent.base import GDNMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] the step's tokens, requests concatenated (decodes first)
    positions: torch.Tensor  # [T] position of each token in its request
    attn: AttentionMetadata  # the attention backend's metadata (paged KV layers)
    logits_indices: torch.Tensor  # [num_sampled] rows whose hidden state gives logits
    state: GDNMetadata | None = None  # the recurrent backend's metadata (Gated DeltaNet layers)
    mm: MultiModalBatch | None = None  # image rows and [3, T] positions, when a request has images


@dataclass
class MultiModalBatch:
    """The images of a step (``worker/mm_inputs.py``): M-RoPE positions for every token, and
    the vision tower's rows that replace the image placeholders' embeddings."""

    mrope_positions: torch.Tensor  # [3, T]
    rows: torch.Tensor | None = None  # [R] batch rows of image tokens
    embeds: torch.Tensor | None = None  # [R, hidden]
    deepstack: list[torch.Tensor] = field(default_factory=list)  # [R, hidden] per tapped layer
