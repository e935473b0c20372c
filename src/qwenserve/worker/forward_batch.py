"""ForwardBatch: everything one forward pass needs, passed to the model as an argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] the step's tokens, requests concatenated (decodes first)
    positions: torch.Tensor  # [T] position of each token in its request
    attn: Any  # the attention backend's metadata (paged KV layers)
    logits_indices: torch.Tensor  # [num_sampled] rows whose hidden state gives logits
    state: Any = None  # the recurrent backend's metadata (Gated DeltaNet layers), if any
