"""The vision tower of Qwen3-VL and Qwen3.5: pixels of several images -> language-model tokens.

    pixel_values [N patches, C*T*P*P]   (the processor's layout, images concatenated)
      -> patch embedding (a linear over each flattened T x P x P patch: the checkpoint's Conv3d
         with stride = kernel, reshaped)
      + learned position table resampled to each image's grid (bilinear)
      -> depth x VisionBlock with 2-D rotary (row, col) and per-frame attention
      -> merger: [N / merge^2, out_hidden_size]
    Qwen3-VL also taps the hidden states after ``deepstack_visual_indexes`` blocks through their
    own mergers; the decoder adds those to its first layers' outputs at the image tokens.

Checkpoint tensors sit under ``model.visual.`` (``VISION_PREFIX``); ``load_weights`` takes the
names below it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.layers.backends import LinearFn
from qwenserve.layers.linear import ReplicatedLinear, UnquantizedLinearMethod, copy_checked
from qwenserve.layers.varlen_attention import VarlenAttention, sdpa_varlen_attention
from qwenserve.models.base import check_all_loaded
from qwenserve.models.vision.grid import Grid, frame_cu_seqlens, pos_embed_taps, rotary_positions
from qwenserve.models.vision.layers import PatchMerger, VisionBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig

VISION_PREFIX = "model.visual."


@dataclass
class VisionOutput:
    """Tokens for the language model, images concatenated in input order."""

    embeds: torch.Tensor  # [num_tokens, out_hidden_size]
    deepstack: list[torch.Tensor]  # one [num_tokens, out_hidden_size] per deep-stack layer

    def split(self, tokens_per_image: Sequence[int]) -> list[VisionOutput]:
        """One output per image (for the encoder cache, which keeps images apart)."""
        sizes = list(tokens_per_image)
        embeds = self.embeds.split(sizes)
        layers = [d.split(sizes) for d in self.deepstack]
        return [VisionOutput(e, [layer[i] for layer in layers]) for i, e in enumerate(embeds)]


class Qwen3VisionTower(nn.Module):
    """Built from the HF ``vision_config``; heads, MLP and mergers split over ``tp``; every GEMM
    through ``linear`` (the platform's float GEMM, as the text layers)."""

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype, tp: ParallelGroup = SINGLE,
                 attention: VarlenAttention = sdpa_varlen_attention,
                 linear: LinearFn = F.linear) -> None:
        super().__init__()
        method = UnquantizedLinearMethod(linear)  # stateless: one for every layer
        self.merge = cfg.spatial_merge_size
        self.head_dim = cfg.hidden_size // cfg.num_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type {rope['rope_type']!r} is not supported; "
                             "the Qwen vision tower uses 'axial'")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = ReplicatedLinear(patch_dim, cfg.hidden_size, bias=True,
                                                 dtype=dtype, quant_method=method)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.grid_side = int(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype, tp, attention, method)
                                    for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype, tp, norm_after_shuffle=False, linear=method)
        self.deepstack_indexes = list(getattr(cfg, "deepstack_visual_indexes", None) or [])
        if self.deepstack_indexes:
            self.deepstack_merger_list = nn.ModuleList(
                PatchMerger(cfg, dtype, tp, norm_after_shuffle=True, linear=method)
                for _ in self.deepstack_indexes)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> VisionOutput:
        grids = [tuple(int(x) for x in g) for g in grids]
        x = self.patch_embed.proj(pixel_values.to(self.dtype))  # [N, hidden]
        x = x + self._position_embeddings(grids, x.device).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)
        cu_seqlens = frame_cu_seqlens(grids)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens)
            if i in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(i)]
                deepstack.append(merger(x))
        return VisionOutput(self.merger(x), deepstack)

    def _position_embeddings(self, grids: list[Grid], device: torch.device) -> torch.Tensor:
        indices, weights = pos_embed_taps(grids, self.merge, self.grid_side)
        taps = self.pos_embed(indices.to(device))  # [N, 4, hidden]
        return (taps * weights.to(device)[:, :, None]).sum(1)  # fp32, as HF computes it

    def _rotary(self, grids: list[Grid],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim] (fp32): a quarter of the frequencies per axis, twice."""
        spatial = self.head_dim // 2
        exponent = torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial
        inv_freq = 1.0 / (self.rope_theta**exponent)
        positions = rotary_positions(grids, self.merge).to(device)  # [N, 2]
        freqs = positions[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
        angles = freqs.flatten(1)  # [N, head_dim / 2]: rows' freqs, then cols'
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named below ``model.visual.``; returns the parameter names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"checkpoint tensor {VISION_PREFIX + name!r} does not belong "
                                 "to the vision tower; does config.json's vision_config match "
                                 "the weights?")
            param = params[name]
            with torch.no_grad():
                if name.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
                    block = self.blocks[int(name.split(".")[1])]
                    block.attn.load_fused_qkv(name.rsplit(".", 1)[1], tensor)
                elif name == "patch_embed.proj.weight":  # Conv3d [out, C, T, P, P]
                    copy_checked(param.data, tensor.reshape(tensor.shape[0], -1).to(param.dtype),
                                 name)
                elif hasattr(param, "weight_loader"):
                    param.weight_loader(param, tensor.to(param.dtype))
                else:
                    copy_checked(param.data, tensor.to(param.dtype), name)
            loaded.add(name)
        check_all_loaded(self, loaded, "the checkpoint's vision tower")
        return loaded
