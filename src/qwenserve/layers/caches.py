"""ModelCaches: every layer's cache tensors, typed by kind, passed to the model each step.

    kv[layer_id]     [2, num_kv_slots, Hkv, D]   paged K/V of an attention layer; KV slot
                                                 ``block_id * block_size + offset``
    state[layer_id]  RecurrentState              a Gated DeltaNet layer's pools, indexed by
                                                 state slot (layouts in layers/recurrent/base.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RecurrentState:
    conv: torch.Tensor  # [num_state_slots, K-1, conv_dim] model dtype
    ssm: torch.Tensor  # [num_state_slots, Hv, Dk, Dv] --mamba-ssm-cache-dtype (float32)


@dataclass
class ModelCaches:
    kv: dict[int, torch.Tensor] = field(default_factory=dict)
    state: dict[int, RecurrentState] = field(default_factory=dict)

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy state slots ``src[i] -> dst[i]`` in every Gated DeltaNet layer (prefix-cache
        checkpoints); no slot may be in both."""
        for state in self.state.values():
            for pool in (state.conv, state.ssm):
                pool.index_copy_(0, dst, pool.index_select(0, src))
