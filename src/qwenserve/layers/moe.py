"""Mixture-of-experts layers (Qwen3-MoE, Qwen3.5-MoE, Qwen2-MoE style): routing and grouped experts.

Experts are stacked parameters, ``w13`` [E, 2*I, H] (gate rows, then up rows) and ``w2`` [E, H, I],
so a faster backend (grouped GEMM, torch_npu's grouped matmul) can take them as they are. The
reference groups token-expert pairs by expert and runs one SwiGLU per active expert, through the
layer's ``ExpertMethod`` (float here; INT8 W8A8 in ``quantization/expert_methods.py``).

Sharding (tensor or expert parallelism): a ``MoEShard`` says which experts and which
slice of the intermediate dimension this rank holds. The loaders slice full checkpoint tensors
into it, and ``forward`` returns this rank's partial sum (routes to experts held elsewhere are
skipped); the caller all-reduces. With the default shard the layer is complete.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve.distributed.parallel_group import ParallelGroup

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.(weight\w*)$")
_SHARED = re.compile(r"^(gate_proj|up_proj|down_proj)\.(weight\w*)$")
# Per-expert tensors of INT8 checkpoints besides ``weight``: the per-output-channel scale, and the
# all-zero offsets some exporters write for symmetric weights (ModelSlim ``weight_offset``,
# compressed-tensors ``weight_zero_point``), checked as they arrive and not kept.
_SCALE = "weight_scale"
_ZERO_POINTS = ("weight_offset", "weight_zero_point")


class ExpertMethod(Protocol):
    """How a ``FusedMoE`` stores its experts and runs one expert's SwiGLU (float, INT8 W8A8).

    ``create_weights`` registers ``w13`` [E, 2I, H] and ``w2`` [E, H, I] (and, when quantized,
    ``w13_scale`` [E, 2I, 1] and ``w2_scale`` [E, H, 1] float32, one per output channel);
    ``expert_mlp`` computes down(silu(gate(x)) * up(x)) for local expert ``expert``."""

    quantized: bool  # INT8 weights with per-channel scales

    def create_weights(self, layer: nn.Module, num_local: int, inter: int, hidden: int,
                       dtype: torch.dtype | None) -> None: ...

    def expert_mlp(self, layer: nn.Module, x: torch.Tensor, expert: int) -> torch.Tensor: ...


class FloatExperts:
    """Experts in the model dtype (the default method)."""

    quantized = False

    def create_weights(self, layer: nn.Module, num_local: int, inter: int, hidden: int,
                       dtype: torch.dtype | None) -> None:
        layer.w13 = nn.Parameter(torch.empty(num_local, 2 * inter, hidden, dtype=dtype))
        layer.w2 = nn.Parameter(torch.empty(num_local, hidden, inter, dtype=dtype))

    def expert_mlp(self, layer: nn.Module, x: torch.Tensor, expert: int) -> torch.Tensor:
        return swiglu(x, layer.w13[expert], layer.w2[expert])


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's Qwen3-MoE / Qwen3.5-MoE router: softmax over ALL experts in fp32, top-k, optional
    renormalisation (Qwen3.5-MoE always; Qwen3-MoE per ``norm_topk_prob``), weights cast back
    to the logits' dtype. router_logits [T, E] -> (weights [T, k], expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with w13 [2*I, H] (gate rows first) and w2 [H, I]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)


def fused_experts(
    x: torch.Tensor,
    expert_mlp: Callable[[torch.Tensor, int], torch.Tensor],
    num_local: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
) -> torch.Tensor:
    """Sum of the routed experts' outputs: x [T, H], topk_* [T, k] (global expert ids; this rank
    holds experts ``expert_start .. expert_start + num_local - 1``; ``expert_mlp(xs, e)`` runs
    local expert ``e`` on its tokens) -> [T, H].

    The T*k (token, expert) pairs are sorted by expert so each expert's tokens are contiguous:

        pairs (token*k + j)  0:e5 1:e2 2:e2 3:e7      sorted: e2 [1, 2] | e5 [0] | e7 [3]
        token of pair p = p // k;  results are weighted and index_add_-ed back to their token
    """
    num_tokens, top_k = topk_ids.shape
    local = topk_ids.reshape(-1) - expert_start  # [T*k]
    pairs = torch.arange(num_tokens * top_k, device=x.device)  # [T*k]
    held = (local >= 0) & (local < num_local)
    local, pairs = local[held], pairs[held]
    order = torch.argsort(local, stable=True)
    pairs = pairs[order]  # [P] grouped by expert
    tokens = pairs // top_k  # [P]
    counts = torch.bincount(local, minlength=num_local).tolist()  # host: per-expert sizes
    xs = x.index_select(0, tokens)  # [P, H]
    ys = torch.empty_like(xs)  # [P, H]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            ys[start : start + count] = expert_mlp(xs[start : start + count], expert)
            start += count
    ys = ys * topk_weights.reshape(-1)[pairs, None]
    return torch.zeros_like(x).index_add_(0, tokens, ys)


@dataclass(frozen=True)
class MoEShard:
    """What one rank holds: experts ``[expert_start, expert_start + num_local_experts)`` and the
    ``tp_rank``-th of ``tp_size`` equal slices of every expert's intermediate dimension."""

    expert_start: int = 0
    num_local_experts: int | None = None  # None: all experts from expert_start
    tp_rank: int = 0
    tp_size: int = 1

    def expert_range(self, num_experts: int) -> range:
        count = self.num_local_experts or num_experts - self.expert_start
        return range(self.expert_start, self.expert_start + count)

    @classmethod
    def expert_parallel(cls, num_experts: int, rank: int, world_size: int) -> MoEShard:
        """Whole experts split over ``world_size`` ranks, contiguous, the first
        ``num_experts % world_size`` ranks holding one more (as vLLM places them)::

            10 experts, 4 ranks:  rank 0: 0-2 | rank 1: 3-5 | rank 2: 6-7 | rank 3: 8-9
        """
        if num_experts < world_size:
            raise ValueError(f"--enable-expert-parallel needs at least one expert per rank: "
                             f"{num_experts} experts < {world_size} ranks; drop the flag")
        base, extra = divmod(num_experts, world_size)
        start = rank * base + min(rank, extra)
        return cls(expert_start=start, num_local_experts=base + (rank < extra))

    def intermediate_slice(self, intermediate_size: int) -> slice:
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"intermediate size {intermediate_size} not divisible by tp {self.tp_size}"
            )
        size = intermediate_size // self.tp_size
        return slice(self.tp_rank * size, (self.tp_rank + 1) * size)


class FusedMoE(nn.Module):
    """Routed experts as two stacked parameters; ``forward(x, router_logits)``.

    Checkpoint names relative to this module (``...mlp.experts.``), both accepted by
    ``load_weight``: per-expert ``{e}.gate_proj.weight`` [I, H], ``{e}.up_proj.weight`` [I, H],
    ``{e}.down_proj.weight`` [H, I]; or fused ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I].
    INT8 experts (``method`` quantized) come per expert, each weight int8 with its
    ``weight_scale`` [rows, 1]: gate/up scales are sliced with their rows under tensor
    parallelism, down's (one per hidden row) are whole on every rank.
    """

    # registered by the ExpertMethod: [E_local, 2I, H] and [E_local, H, I] (int8 when quantized,
    # with float32 ``w13_scale`` [E_local, 2I, 1] and ``w2_scale`` [E_local, H, 1])
    w13: nn.Parameter
    w2: nn.Parameter

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
        shard: MoEShard | None = None,
        method: ExpertMethod | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shard = shard or MoEShard()
        self.local_experts = self.shard.expert_range(num_experts)
        self.i_slice = self.shard.intermediate_slice(intermediate_size)
        num_local, inter = len(self.local_experts), self.i_slice.stop - self.i_slice.start
        self.method = method or FloatExperts()
        self.method.create_weights(self, num_local, inter, hidden_size, dtype)
        self.quantized = self.method.quantized

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] (this rank's partial sum when sharded)."""
        weights, ids = route_topk(router_logits, self.top_k, self.renormalize)
        return fused_experts(x, self.expert_mlp, len(self.local_experts), weights, ids,
                             self.local_experts.start)

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Local expert ``expert``'s SwiGLU on x [n, H] -> [n, H]."""
        return self.method.expert_mlp(self, x, expert)

    @torch.no_grad()
    def load_expert(self, expert_id: int, shard_id: str, tensor: torch.Tensor,
                    kind: str = "weight") -> None:
        """Copy one expert's full ``gate``/``up`` [I, H] or ``down`` [H, I] (``kind`` "weight"),
        or its per-row ``weight_scale`` [I, 1] / [H, 1], into its local slice; experts held by
        other ranks are skipped."""
        what = f"expert {expert_id} {shard_id}_proj.{kind}"
        if not self._accepts(kind, tensor, what) or expert_id not in self.local_experts:
            return
        e, inter = expert_id - self.local_experts.start, self.w2.shape[-1]
        w13, w2 = (self.w13, self.w2) if kind == "weight" else (self.w13_scale, self.w2_scale)
        if shard_id == "down":
            if kind == "weight":
                _check(tensor, (self.hidden_size, self.intermediate_size), what)
                w2[e].copy_(tensor[:, self.i_slice])
            else:  # one scale per hidden row: not sliced by tensor parallelism
                w2[e].copy_(_rows(tensor, self.hidden_size, what))
            return
        if kind == "weight":
            _check(tensor, (self.intermediate_size, self.hidden_size), what)
        else:
            tensor = _rows(tensor, self.intermediate_size, what)
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}[shard_id]
        w13[e, rows].copy_(tensor[self.i_slice])

    def _accepts(self, kind: str, tensor: torch.Tensor, what: str) -> bool:
        """Whether ``tensor`` has a place here: INT8 weights and their scales only in quantized
        experts, float weights only in float ones; all-zero offsets are checked and dropped."""
        if kind == "weight":
            if self.quantized and tensor.dtype != torch.int8:
                raise ValueError(f"{what}: the quantization config marks these experts INT8 but "
                                 f"the checkpoint holds a {tensor.dtype} weight; the checkpoint's "
                                 "config does not match its tensors")
            if not self.quantized and not tensor.is_floating_point():
                raise ValueError(f"{what}: the checkpoint holds {tensor.dtype} expert weights but "
                                 "its quantization config leaves these experts float; the "
                                 "checkpoint's config does not match its tensors")
            return True
        if not self.quantized or kind not in (_SCALE, *_ZERO_POINTS):
            raise KeyError(f"FusedMoE: unexpected tensor {what} for "
                           f"{'INT8' if self.quantized else 'float'} experts")
        if kind in _ZERO_POINTS:
            if tensor.abs().max().item() != 0:
                raise ValueError(f"{what} is not zero (asymmetric int8 weights); qwenserve runs "
                                 "symmetric weights only: export with symmetric weights")
            return False
        return True

    @torch.no_grad()
    def load_fused(self, kind: str, tensor: torch.Tensor) -> None:
        """Copy the hub's fused ``gate_up`` [E, 2I, H] or ``down`` [E, H, I] tensor."""
        if self.quantized:
            raise ValueError(f"experts.{kind}_proj: fused expert tensors in an INT8 checkpoint; "
                             "qwenserve loads INT8 experts per expert ({e}.gate_proj.weight with "
                             "its weight_scale), as ModelSlim and llm-compressor write them")
        full = self.intermediate_size
        experts = slice(self.local_experts.start, self.local_experts.stop)
        if kind == "down":
            _check(tensor, (self.num_experts, self.hidden_size, full), "experts.down_proj")
            self.w2.copy_(tensor[experts, :, self.i_slice])
            return
        _check(tensor, (self.num_experts, 2 * full, self.hidden_size), "experts.gate_up_proj")
        gate, up = tensor[experts, :full], tensor[experts, full:]
        self.w13.copy_(torch.cat([gate[:, self.i_slice], up[:, self.i_slice]], dim=1))

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Load a checkpoint tensor by its name relative to this module (either layout)."""
        if match := _PER_EXPERT.match(name):
            self.load_expert(int(match[1]), match[2].removesuffix("_proj"), tensor, match[3])
        elif name.removesuffix(".weight") in ("gate_up_proj", "down_proj"):
            self.load_fused(name.removesuffix(".weight").removesuffix("_proj"), tensor)
        else:
            raise KeyError(f"FusedMoE: unexpected weight name {name!r}")


def _check(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)}, expected {shape}")


def _rows(scale: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """A per-output-channel scale, stored [rows, 1] or [rows], as [rows, 1]."""
    if scale.numel() != rows or scale.dim() > 2:
        raise ValueError(f"{what}: checkpoint shape {tuple(scale.shape)}, expected ({rows}, 1)")
    return scale.reshape(rows, 1)


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward block: router ``gate`` [E, H], routed ``experts`` and, when
    ``shared_intermediate_size`` > 0, a SwiGLU ``shared_expert`` scaled by
    ``sigmoid(shared_expert_gate(x))`` (Qwen3.5-MoE, Qwen2-MoE; Qwen3-MoE has none).

    The shared expert is sliced on the intermediate dimension (``shared_shard``, by default the
    routed experts' tensor-parallel slice), so the output stays a partial sum under tensor
    parallelism; with expert parallelism the routed experts are whole per rank and the shared
    one stays sliced, and the sum of both partial sums is still the caller's one all-reduce.
    ``load_weight`` takes names relative to the block (``mlp.``).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        shared_intermediate_size: int = 0,
        dtype: torch.dtype | None = None,
        shard: MoEShard | None = None,
        shared_shard: MoEShard | None = None,
        method: ExpertMethod | None = None,
        shared_method: ExpertMethod | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)  # router
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, renormalize, dtype, shard, method
        )
        self.shared_expert: FusedMoE | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            tp = shared_shard or MoEShard(tp_rank=self.experts.shard.tp_rank,
                                          tp_size=self.experts.shard.tp_size)
            # a one-expert FusedMoE holds the shared SwiGLU with the same slicing rules
            self.shared_expert = FusedMoE(
                1, 1, hidden_size, shared_intermediate_size, False, dtype, tp, shared_method
            )
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + self.shared_output(x)
        return out

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The gated shared expert: sigmoid(shared_expert_gate(x)) * SwiGLU(x), [T, H]."""
        assert self.shared_expert is not None and self.shared_expert_gate is not None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.expert_mlp(x, 0)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """``gate.weight``, ``experts.*`` (either layout), ``shared_expert.{gate,up,down}_proj
        .weight`` (and INT8 ``.weight_scale``), ``shared_expert_gate.weight``."""
        if name.startswith("experts."):
            self.experts.load_weight(name.removeprefix("experts."), tensor)
        elif (name.startswith("shared_expert.") and self.shared_expert is not None
              and (match := _SHARED.match(name.removeprefix("shared_expert.")))):
            self.shared_expert.load_expert(0, match[1].removesuffix("_proj"), tensor, match[2])
        elif name == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            self.shared_expert_gate.weight.copy_(tensor)
        elif name == "gate.weight":
            self.gate.weight.copy_(tensor)
        else:
            raise KeyError(f"SparseMoeBlock: unexpected weight name {name!r}")


def is_moe_layer(cfg: PretrainedConfig, layer_id: int) -> bool:
    """Sparse-MoE MLP here? Every ``decoder_sparse_step``-th layer, minus ``mlp_only_layers``
    (every layer in the released Qwen3-MoE and Qwen3.5-MoE models)."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (getattr(cfg, "num_experts", 0) > 0 and (layer_id + 1) % step == 0
            and layer_id not in (getattr(cfg, "mlp_only_layers", None) or ()))


class MoEBlock(SparseMoeBlock):
    """The MoE feed-forward block of a decoder layer, sized from the model config; its
    tensor-parallel partial sums are all-reduced (one collective, as for a dense MLP).

    ``renormalize`` None: the config's ``norm_topk_prob`` decides (Qwen3-MoE, Qwen3-Next).
    ``method`` / ``shared_method``: how the routed / shared experts compute (float by default;
    ``ModelContext.expert_method`` gives the checkpoint's INT8 method).

    Tensor parallelism slices every expert's intermediate dimension; expert parallelism
    (``expert_parallel``, ``--enable-expert-parallel``) gives each rank whole experts instead, as
    vLLM does over the TP ranks, while the shared expert stays sliced. Either way each rank's
    output is a partial sum of the block's output, so one all-reduce completes it: tokens are
    replicated on every rank, so the all-gather/reduce-scatter dispatch of vLLM's all-to-all
    backends reduces to this when there is no data parallelism.

    With data parallelism (``dp_ep``: one group over every rank of every data-parallel replica)
    each replica has its own tokens and each rank whole experts of its own: ``forward``
    all-gathers every replica's tokens (padded to the largest count), runs this rank's experts on
    all of them, adds its own tokens' shared expert (its tensor-parallel slice) in its replica's
    rows, all-reduces and keeps its replica's rows::

        replica r: x [n_r, H] --all-gather--> [R*m, H] --local experts--> partial [R*m, H]
                   + shared(x) in rows r*m .. r*m+n_r --all-reduce--> keep rows r*m .. r*m+n_r

    Every replica must call it the same number of times: an idle replica runs it on zero
    tokens (``run_idle``), as vLLM's idle data-parallel ranks run dummy batches."""

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype, tp: ParallelGroup,
                 shared_intermediate_size: int = 0, renormalize: bool | None = None,
                 expert_parallel: bool = False, dp_ep: ParallelGroup | None = None,
                 method: ExpertMethod | None = None,
                 shared_method: ExpertMethod | None = None) -> None:
        if dp_ep is not None and dp_ep.world_size > tp.world_size:
            ep = dp_ep
        else:
            dp_ep, ep = None, tp
        sliced = MoEShard(tp_rank=tp.rank, tp_size=tp.world_size)
        shards = ({"shard": MoEShard.expert_parallel(cfg.num_experts, ep.rank, ep.world_size),
                   "shared_shard": sliced} if expert_parallel or dp_ep is not None
                  else {"shard": sliced})
        super().__init__(
            num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
            renormalize=bool(getattr(cfg, "norm_topk_prob", True)) if renormalize is None
            else renormalize,
            shared_intermediate_size=shared_intermediate_size, dtype=dtype,
            method=method, shared_method=shared_method, **shards)
        for p in self.parameters():
            p.requires_grad_(False)
        self.tp = tp
        self.dp_ep = dp_ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_ep is None:
            return self.tp.all_reduce(super().forward(x))
        return self._forward_across_replicas(x, self.dp_ep)

    def _forward_across_replicas(self, x: torch.Tensor, ep: ParallelGroup) -> torch.Tensor:
        """The tokens are the same on a replica's tensor-parallel ranks: gathered over all
        ranks, one copy per replica is kept (its tensor-parallel rank 0's)."""
        n, tp = x.shape[0], self.tp.world_size
        counts = ep.all_gather(torch.tensor([n], dtype=torch.int64), dim=0).tolist()
        m = max(counts)
        if m == 0:
            return x
        padded = x.new_zeros(m, x.shape[1])
        padded[:n] = x
        gathered = ep.all_gather(padded, dim=0)  # [R*tp*m, H]
        everyone = gathered.view(-1, tp, m, x.shape[1])[:, 0].reshape(-1, x.shape[1])  # [R*m, H]
        out = self.experts(everyone, self.gate(everyone))
        replica = ep.rank // tp
        own = slice(replica * m, replica * m + n)
        if self.shared_expert is not None and n:
            out[own] += self.shared_output(x)
        return ep.all_reduce(out)[own]

    def run_idle(self) -> None:
        """This replica's part of a step it has no tokens for (data parallelism only)."""
        if self.dp_ep is not None:
            self.forward(self.gate.weight.new_zeros(0, self.gate.in_features))


def run_idle_moe(model: nn.Module) -> None:
    """An idle data-parallel replica's dummy step: each MoE layer's exchange, in layer order,
    with zero tokens (nothing else in the forward pass talks to the other replicas)."""
    for module in model.modules():
        if isinstance(module, MoEBlock):
            module.run_idle()
