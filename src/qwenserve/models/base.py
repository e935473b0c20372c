"""What every model provides (``CausalLM``, ``ModelClass``), and the shared weight-loading loop.

A model is built from a ``ModelContext`` (config, dtype, parallel group, backends) and exposes
``forward(input_ids, positions, batch, caches: ModelCaches) -> hidden``, ``compute_logits(hidden)``,
``greedy_tokens(hidden)`` (a greedy step's tokens without logits, where the platform can),
``load_weights(weights)`` and the classmethod ``cache_specs(hf_config, tp_size, kv_dtype_bytes,
ssm_dtype_bytes)``. The worker sees a model only through these two protocols.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.layers.backends import Backends
from qwenserve.layers.caches import ModelCaches, RecurrentState
from qwenserve.layers.forward_batch import ForwardBatch
from qwenserve.layers.linear import LinearMethod, UnquantizedLinearMethod
from qwenserve.layers.moe import ExpertMethod
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from qwenserve.core.cache.spec import CacheSpec
    from qwenserve.quantization.quant_config import QuantConfig

logger = init_logger(__name__)


@dataclass(frozen=True)
class ModelContext:
    """Everything a model needs to build its layers (the worker makes one per rank)."""

    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    tp: ParallelGroup = SINGLE
    backends: Backends = field(default_factory=Backends.reference)  # the platform's kernels
    quant: QuantConfig | None = None  # quantized checkpoints: a linear method per layer
    ssm_dtype: torch.dtype = torch.float32  # Gated DeltaNet state (--mamba-ssm-cache-dtype)
    expert_parallel: bool = False  # MoE experts whole per rank (--enable-expert-parallel)
    dp_ep: ParallelGroup | None = None  # the MoE group over data-parallel replicas (DP x EP)

    def linear_method(self, prefix: str) -> LinearMethod:
        """How the linear layer at ``prefix`` computes: the quantization's method for it, else
        the platform's float GEMM."""
        method = self.quant.linear_method(prefix) if self.quant is not None else None
        return method or UnquantizedLinearMethod(self.backends.float_linear)

    def expert_method(self, prefix: str, num_experts: int = 1) -> ExpertMethod | None:
        """How the MoE experts at ``prefix`` (``model.layers.3.mlp.experts``, or a one-expert
        ``...mlp.shared_expert``) compute: the quantization's method, or None (float)."""
        return self.quant.expert_method(prefix, num_experts) if self.quant is not None else None


class CausalLM(Protocol):
    """The model contract: what the worker, the model runner, the pooler and a draft-model
    proposer call on a built model (``DenseForCausalLM`` and every architecture derived from it).
    """

    lm_head: nn.Module | None  # None: an embedding model (--runner pooling, --task embed)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                 caches: ModelCaches) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden] last hidden states."""
        ...

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits (gathered over tensor-parallel ranks) in ``dtype``;
        None: the LM head's own (the sampler widens them only where it must)."""
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> [n] int64, ``compute_logits(hidden, None).argmax(-1)`` bit for bit
        (the first of equal maxima) where the platform's fused LM head takes the call, without
        the [n, vocab] logits (a greedy step's sampler needs no more); None elsewhere."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None: ...

    def allocate_state(self, num_state_slots: int, device: torch.device
                       ) -> list[RecurrentState]:
        """One state pool per recurrent layer (models without recurrent layers: none)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def eval(self) -> nn.Module: ...


@runtime_checkable
class TokenScorer(Protocol):
    """A model with a score head over every token (reward models, ``Qwen2ForRewardModel``)."""

    num_labels: int

    def score_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, num_labels] raw scores."""
        ...


class ModelClass(Protocol):
    """An architecture as the registry returns it: built from a context, and able to say what
    cache it needs before it is built (the cache plan is made from the config alone)."""

    def __call__(self, ctx: ModelContext) -> CausalLM: ...

    def cache_specs(self, hf_config: PretrainedConfig, tp_size: int, kv_dtype_bytes: int,
                    ssm_dtype_bytes: int = 4) -> list[CacheSpec]: ...


def config_head_dim(hf_config: PretrainedConfig) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split over ranks, or one replicated head per rank when there are fewer."""
    return max(1, num_kv_heads // tp_size)


# (parameter name fragment, checkpoint name fragment, shard id) for stacked projections
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: tuple[tuple[str, str, Any], ...] = STACKED_PARAMS,
    skip: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> set[str]:
    """Copy checkpoint tensors into the model through each parameter's ``weight_loader``.

    Returns the names of the parameters that were loaded; unknown checkpoint names raise.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        target, shard_id = _map_name(name, params, stacked)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to this model; does "
                             "config.json's architecture match the weights?")
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)} but the "
                                     f"model expects {tuple(param.shape)}")
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, _cast_for(param, tensor))
            else:
                loader(param, _cast_for(param, tensor), shard_id)
        loaded.add(target)
    return loaded


def split_module_weights(
    weights: Iterable[tuple[str, torch.Tensor]], modules: dict[str, nn.Module], loaded: set[str]
) -> Iterable[tuple[str, torch.Tensor]]:
    """Send tensors under a prefix in ``modules`` (e.g. an MoE block's ``model.layers.3.mlp.``)
    to that module's own ``load_weight(relative_name, tensor)``; yield the others.

    The module's parameters are marked loaded (for ``check_all_loaded``) as ``prefix + name``.
    """
    for name, tensor in weights:
        prefix = _module_prefix(name, modules)
        if prefix is None:
            yield name, tensor
            continue
        module = modules[prefix]
        module.load_weight(name[len(prefix):], tensor)
        loaded.update(prefix + n for n, _ in module.named_parameters())


def _module_prefix(name: str, modules: dict[str, nn.Module]) -> str | None:
    head = name
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head + "." in modules:
            return head + "."
    return None


def _cast_for(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Float tensors take a float parameter's dtype; anything else arrives as stored (int8
    weights, int32/int64 quantization parameters, float rows that a quantizing loader turns
    into int8), so no cast can silently truncate."""
    if tensor.is_floating_point() and param.is_floating_point():
        return tensor.to(param.dtype)
    return tensor


def _map_name(name: str, params: dict, stacked: tuple) -> tuple[str | None, Any]:
    for param_part, ckpt_part, shard_id in stacked:
        if f".{ckpt_part}." in name:
            candidate = name.replace(f".{ckpt_part}.", f".{param_part}.")
            if candidate in params:
                return candidate, shard_id
    return (name, None) if name in params else (None, None)


def check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    # ``optional`` parameters (quantization tensors that some exporters omit) may be absent.
    missing = [n for n, p in model.named_parameters()
               if n not in loaded and not getattr(p, "optional", False)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise ValueError(f"{source} lacks weights for {shown}; the checkpoint is incomplete or "
                         "does not match config.json")
