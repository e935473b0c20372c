"""Engine configuration: frozen, typed values that each component receives its part of.

They are plain data (no torch, no imports from the rest of qwenserve), so every layer, ``core/``
included, may read them, and they cross process boundaries under tensor parallelism.
``engine/arg_utils.py`` builds them from the user's options (``EngineArgs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qwenserve import envs
from qwenserve.kv_transfer.config import KVTransferConfig
from qwenserve.multimodal.config import MultiModalConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``folder`` holds config/tokenizer; ``gguf_file`` is set for GGUF models."""

    name: str  # what the user asked for (used as the served model name)
    folder: str
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model, read from config.json or GGUF."""

    source: ModelSource
    architecture: str
    hf_config: PretrainedConfig = field(repr=False)  # the text config (as config.json names it)
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    tokenizer: str  # folder or hub id
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, object] = field(default_factory=dict)  # generation_config
    quantization: str | None = None  # one of quantization.schemes.METHODS
    quant_config: dict[str, object] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def has_vision(self) -> bool:
        """A vision tower is built (a vision-language checkpoint without
        --language-model-only)."""
        return getattr(self.hf_config, "vision_config", None) is not None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers


SSM_STATE_DTYPES = ("float32", "bfloat16", "float16")


def resolve_ssm_cache_dtype(flag: str, hf_config: PretrainedConfig) -> str:
    """``--mamba-ssm-cache-dtype`` for this model. ``auto`` takes the checkpoint's
    ``mamba_ssm_dtype`` (Qwen3.5's config.json says float32), as vLLM does; without that field
    the state stays float32, the precision Hugging Face's reference keeps it in, where vLLM
    would take the model dtype (a bf16 Qwen3-Next state there). A dtype given by the flag wins
    over the checkpoint's (logged, as vLLM warns), and is the way past a declared dtype the
    engine cannot keep."""
    declared = getattr(hf_config, "mamba_ssm_dtype", None)
    if flag != "auto":
        if declared is not None and flag != declared:
            from qwenserve.logger import init_logger

            init_logger(__name__).warning(
                "the checkpoint's config.json sets mamba_ssm_dtype=%s; --mamba-ssm-cache-dtype "
                "%s overrides it", declared, flag)
        return flag
    if declared is not None and declared not in SSM_STATE_DTYPES:
        raise ValueError(f"the checkpoint's config.json sets mamba_ssm_dtype={declared!r}, which "
                         f"is not a state dtype qwenserve keeps ({', '.join(SSM_STATE_DTYPES)}): "
                         "pass --mamba-ssm-cache-dtype with one of them")
    return declared or "float32"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None = None
    # Gated DeltaNet state (resolve_ssm_cache_dtype's value); auto: float32
    mamba_ssm_cache_dtype: str = "auto"

    @property
    def ssm_state_dtype(self) -> str:
        return "float32" if self.mamba_ssm_cache_dtype == "auto" else self.mamba_ssm_cache_dtype

    def cpu_budget_bytes(self) -> int:
        """CPU KV budget: the flag, else QWENSERVE_CPU_KVCACHE_SPACE GiB, else 4 GiB (vLLM's)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        gib = envs.cpu_kvcache_space_gib()
        return int((gib if gib is not None else 4) * (1 << 30))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0  # most draft tokens verified per request and step
    spec_disable_by_batch_size: int | None = None  # no drafts while this many requests run


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed (``--speculative-config``, parsed in ``spec_decode/config.py``).
    ``disable_by_batch_size``: no drafts while this many or more requests run (vLLM's knob)."""

    method: str  # "ngram" | "draft_model" | "mtp" (the checkpoint's own head) | "eagle3"
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    model: str | None = None  # the drafter (draft_model) or head (eagle3): folder or hub id
    disable_by_batch_size: int | None = None
    # vLLM's draft_tensor_parallel_size: None = the target's; 1 = a draft model on the driver
    # rank only (checked against --tensor-parallel-size in spec_decode/support.py)
    draft_tensor_parallel_size: int | None = None


@dataclass(frozen=True)
class DataParallelRank:
    """A data-parallel replica's place in the expert-parallel group that spans the replicas
    (``--data-parallel-size N --enable-expert-parallel``): rank ``rank`` of ``size``, meeting at
    the store the API process serves on ``host:port``."""

    rank: int
    size: int
    host: str
    port: int


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts whole per rank, not sliced
    # DP x EP: this replica's rank in the MoE group over all replicas (None: no such group)
    data_parallel: DataParallelRank | None = None


@dataclass(frozen=True)
class PoolerConfig:
    """What a pooling model returns for a prompt (``--runner pooling``; rules in
    ``qwenserve/pooling.py``)."""

    kind: str  # "embed" | "classify" | "reward" (every token's output)
    # classify: the LM-head rows whose logits make the score: (negative, positive)
    token_ids: tuple[int, ...] = ()
    # reward: the model's score-head width (0: no head, each token's final hidden state)
    num_labels: int = 0

    @property
    def hidden_states_only(self) -> bool:
        """Whether the output is made of final hidden states (no LM or score head is used)."""
        return self.kind == "embed" or (self.kind == "reward" and not self.num_labels)


@dataclass(frozen=True)
class EngineConfig:
    """The resolved configuration; each component takes only its part."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    platform_name: str
    seed: int = 0
    max_logprobs: int = 20
    multimodal: MultiModalConfig = MultiModalConfig()
    load_format: str = "auto"  # auto | safetensors | dummy | sharded_state
    pooler: PoolerConfig | None = None  # --runner pooling: what a request returns
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None  # the drafter (speculative method draft_model)
    kv_transfer: KVTransferConfig | None = None  # --kv-transfer-config (P/D disaggregation)
    # decode steps of up to this many sequences are recorded and replayed where the platform
    # can (worker/decode_replay.py); 0: every step eager (--enforce-eager)
    decode_replay_max_batch: int = 0
    decode_replay_sizes: tuple[int, ...] = ()  # the batch sizes recorded; empty: all up to the max
