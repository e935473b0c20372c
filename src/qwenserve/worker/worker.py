"""Worker: one device's share of the model: load, size the cache, allocate it, run steps."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from qwenserve.config import EngineConfig, ModelConfig
from qwenserve.core.cache.plan import (
    CachePlan,
    CacheTooSmallError,
    accelerator_kv_budget,
    plan_cache,
)
from qwenserve.core.cache.spec import PagedKVSpec, RecurrentStateSpec
from qwenserve.core.sched_output import (
    ModelOutput,
    NewRequestData,
    ScheduledChunk,
    SchedulerOutput,
)
from qwenserve.distributed.parallel_group import SINGLE, ParallelGroup
from qwenserve.kv_transfer.agent import KVTransferAgent
from qwenserve.layers.backends import Backends
from qwenserve.layers.caches import ModelCaches
from qwenserve.logger import init_logger
from qwenserve.models.base import CausalLM, ModelClass, ModelContext
from qwenserve.models.dense import DecoderModel
from qwenserve.models.dummy_weights import fill_dummy_weights
from qwenserve.models.eagle3 import (
    Eagle3Head,
    eagle3_aux_layer_ids,
    eagle3_cache_spec,
    iter_head_weights,
    load_eagle3_config,
)
from qwenserve.models.loader import iter_safetensors, iter_weights, safetensors_files
from qwenserve.models.qwen3_5_mtp import MTP_PREFIXES
from qwenserve.models.registry import load_model_class
from qwenserve.models.sharded_state import load_sharded_state
from qwenserve.options.compilation import DECODE_REPLAY_BYTES
from qwenserve.sampling_params import SamplingParams
from qwenserve.spec_decode.config import EAGLE3, MTP
from qwenserve.spec_decode.draft_model import DraftModelProposer
from qwenserve.spec_decode.eagle3 import Eagle3Proposer
from qwenserve.spec_decode.lockstep import SpecRanks
from qwenserve.spec_decode.mtp import MtpProposer
from qwenserve.spec_decode.proposer import NgramLookup, Proposer
from qwenserve.spec_decode.support import check_speculative, draft_tensor_parallel_size
from qwenserve.structured_output.request_grammars import RequestGrammars
from qwenserve.structured_output.service import model_grammar_service
from qwenserve.worker.caches import allocate_caches
from qwenserve.worker.decode_replay import DecodeReplays
from qwenserve.worker.dp_passes import LockstepPasses
from qwenserve.worker.model_runner import ModelRunner
from qwenserve.worker.pooler import embedding_checkpoint_names
from qwenserve.worker.warm_up import warm_up_gemms, warm_up_rows

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform
    from qwenserve.quantization.quant_config import QuantConfig

logger = init_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    def __init__(self, config: EngineConfig, platform: Platform, tp: ParallelGroup = SINGLE,
                 local_rank: int = 0, dp_ep: ParallelGroup | None = None):
        """``dp_ep``: the MoE group over data-parallel replicas (DP x EP), if any."""
        self.config = config
        self.tp = tp
        self.dp_ep = dp_ep
        self.platform = platform
        self.platform.configure_process()
        self.device = self.platform.device(local_rank)
        self.dtype = _DTYPES[config.model.dtype]
        self.model_cls = load_model_class(config.model.architecture)
        self.backends = Backends.for_platform(platform)  # the kernels, chosen once
        self.ssm_dtype = _DTYPES[config.cache.ssm_state_dtype]
        self.specs = self.model_cls.cache_specs(config.model.hf_config, tp.world_size,
                                                self.dtype.itemsize, self.ssm_dtype.itemsize)
        # Speculative decoding with a draft model: its own paged KV group in the same budget,
        # sharded like the target, or (draft_tensor_parallel_size 1) whole on the driver only.
        draft = config.draft_model
        self.draft_cls = load_model_class(draft.architecture) if draft is not None else None
        self.draft_tp: ParallelGroup | None = None  # None: this rank runs no drafter
        self.draft_specs = [] if draft is None else self.draft_cls.cache_specs(
            draft.hf_config, tp.world_size, self.dtype.itemsize)
        self.draft_model: CausalLM | None = None
        # MTP: the checkpoint's own head, its attention KV one more paged layer of the target.
        self.use_mtp = config.speculative is not None and config.speculative.method == MTP
        check_speculative(config, self.specs, self.draft_specs,
                          hasattr(self.model_cls, "make_mtp_head"))
        if draft is not None:
            sharded = draft_tensor_parallel_size(config) == tp.world_size
            self.draft_tp = tp if sharded else SINGLE if tp.is_driver else None
            self.draft_specs = [] if self.draft_tp is None else self.draft_cls.cache_specs(
                draft.hf_config, self.draft_tp.world_size, self.dtype.itemsize)
        if self.use_mtp:
            self.specs = self.specs + self.model_cls.mtp_cache_specs(
                config.model.hf_config, tp.world_size, self.dtype.itemsize)
        # EAGLE-3: a separate head; its attention KV likewise one more paged layer.
        self.eagle3 = load_eagle3_config(config.speculative.model, config.model.hf_config) \
            if config.speculative is not None and config.speculative.method == EAGLE3 else None
        if self.eagle3 is not None:
            self.specs = self.specs + [eagle3_cache_spec(
                self.eagle3.hf_config, config.model.hf_config.num_hidden_layers, tp.world_size,
                self.dtype.itemsize)]
        self.mtp_head: nn.Module | None = None
        self._model: CausalLM | None = None
        self.runner: ModelRunner | None = None
        self.plan: CachePlan | None = None
        self.kv_agent: KVTransferAgent | None = None  # --kv-transfer-config
        self.load_s = 0.0

    # ---- start-up -----------------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        self._model = self._load(self.config.model, self.model_cls, self._quant())
        if self.draft_cls is not None and self.draft_tp is not None:
            self.draft_model = self._load(self.config.draft_model, self.draft_cls, None,
                                          draft_tp=self.draft_tp)
        if self.use_mtp:
            self.mtp_head = self._load_mtp_head()
        if self.eagle3 is not None:
            self.mtp_head = self._load_eagle3_head()
        rows = warm_up_rows(self.platform, self.dtype,
                            int8=self.config.model.quantization is not None)  # W8A8's windows
        for model in (self._model, self.draft_model):
            if model is not None:  # packing and the like now, not in the first step
                warm_up_gemms(model, self.dtype, self.device, rows)
        self.load_s = time.perf_counter() - start

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            raise RuntimeError("Worker.load_model() has not run yet")
        return self._model

    def _load(self, mc: ModelConfig, model_cls: ModelClass, quant: QuantConfig | None,
              draft_tp: ParallelGroup | None = None) -> CausalLM:
        """The target model, or (``draft_tp``: its group) a speculative-decoding drafter: its
        own plain checkpoint, never pooled nor loaded from per-rank shards."""
        is_draft = draft_tp is not None
        ctx = ModelContext(hf_config=mc.hf_config, dtype=self.dtype,
                           max_model_len=mc.max_model_len, tp=draft_tp or self.tp,
                           backends=self.backends, quant=quant,
                           ssm_dtype=self.ssm_dtype,
                           expert_parallel=self.config.parallel.enable_expert_parallel,
                           dp_ep=None if is_draft else self.dp_ep)
        try:
            with torch.device(self.device):
                model = model_cls(ctx)
            weights = iter_weights(mc.source, mc.hf_config)
            if not is_draft and self.config.pooler is not None \
                    and self.config.pooler.hidden_states_only:
                model.lm_head = None  # an embedding model has no use (and often no weights)
                weights = embedding_checkpoint_names(weights)
            if self.config.load_format == "dummy":
                fill_dummy_weights(model, self.config.seed)
            elif self.config.load_format == "sharded_state" and not is_draft:
                load_sharded_state(model, mc.source.folder, self.tp.rank, self.tp.world_size)
            else:
                model.load_weights(weights, mc.source.gguf_file or mc.source.folder)
            if ctx.quant is not None:  # scales per shard -> per layer, folded biases
                ctx.quant.process_weights_after_loading(model)
        except torch.OutOfMemoryError as e:
            raise MemoryError(
                f"Not enough device memory to load the weights of {mc.name} in {mc.dtype} on "
                f"{self.device}. Use more devices (--tensor-parallel-size), a quantized "
                "checkpoint (--quantization), or a smaller model."
            ) from e
        model.eval()
        return model

    def _load_mtp_head(self) -> nn.Module:
        """The target checkpoint's ``mtp.*`` head (unquantized; only its tensors are read)."""
        mc = self.config.model
        if mc.source.is_gguf:
            raise ValueError(f"{mc.name}: GGUF files carry no MTP head; --speculative-config "
                             "method mtp needs the safetensors checkpoint")
        ctx = ModelContext(hf_config=mc.hf_config, dtype=self.dtype,
                           max_model_len=mc.max_model_len, tp=self.tp, backends=self.backends,
                           ssm_dtype=self.ssm_dtype,
                           expert_parallel=self.config.parallel.enable_expert_parallel,
                           dp_ep=self.dp_ep)  # DP x EP: the head's MoE layer spans the replicas
        with torch.device(self.device):
            head = self.model.make_mtp_head(ctx)
        if self.config.load_format == "dummy":
            fill_dummy_weights(head, self.config.seed + 1)
        else:
            head.load_weights(iter_safetensors(safetensors_files(mc.source.folder), MTP_PREFIXES),
                              mc.source.folder)
        return head.eval()

    def _load_eagle3_head(self) -> Eagle3Head:
        """The EAGLE-3 head (unquantized, its own folder); turns on the target's aux states."""
        assert self.eagle3 is not None
        decoder = getattr(self.model, "model", None)
        arch = self.config.model.architecture
        if not isinstance(decoder, DecoderModel):
            raise ValueError(f"--speculative-config method eagle3: {arch} does not expose its "
                             "layers' hidden states in qwenserve (dense and MoE Qwen/Llama "
                             "models do); use ngram or draft_model")
        mc = self.config.model
        decoder.aux_layer_ids = eagle3_aux_layer_ids(self.eagle3.hf_config,
                                                     mc.hf_config.num_hidden_layers)
        ctx = ModelContext(hf_config=self.eagle3.hf_config, dtype=self.dtype,
                           max_model_len=mc.max_model_len, tp=self.tp, backends=self.backends)
        with torch.device(self.device):
            head = Eagle3Head(ctx, decoder, mc.hf_config.num_hidden_layers,
                              mc.hf_config.hidden_size)
        if self.config.load_format == "dummy":
            fill_dummy_weights(head, self.config.seed + 1)
        else:
            head.load_weights(iter_head_weights(self.eagle3.folder), self.eagle3.folder)
        return head.eval()

    def _quant(self) -> QuantConfig | None:
        if self.config.model.quantization is None:
            return None
        from qwenserve.quantization import build_quant_method

        return build_quant_method(self.config.model, self.backends.int8_mm)

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        modules = [self.model] + ([self.mtp_head] if self.mtp_head is not None else [])
        for tensor in [t for m in modules for t in [*m.parameters(), *m.buffers()]]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        return total

    def cache_budget_bytes(self) -> int:
        """CPU: the configured budget. Accelerators: utilization x memory - weights - peak
        activations of a profiling forward pass (unless --kv-cache-memory-bytes is given)."""
        cache = self.config.cache
        if not self.platform.is_accelerator:
            return cache.cpu_budget_bytes()
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        from qwenserve.worker.profiler import profile_peak_bytes

        free, total = self.platform.mem_get_info(self.device)  # the weights are loaded
        peak = profile_peak_bytes(self)
        weights = self.weight_bytes()
        used_by_others = max(0, total - free - weights)
        budget = accelerator_kv_budget(total, cache.gpu_memory_utilization, weights, peak,
                                       used_by_others)
        if budget <= 0:
            raise MemoryError(
                f"No device memory left for the KV cache: {total / 2**30:.1f} GiB x "
                f"{cache.gpu_memory_utilization} minus weights ({weights / 2**30:.1f} GiB), "
                f"activations ({peak / 2**30:.1f} GiB) and other processes "
                f"({used_by_others / 2**30:.1f} GiB) is {budget / 2**30:.1f} GiB. Raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens, quantize, or use more "
                "devices (--tensor-parallel-size)."
            )
        return budget

    def plan_cache(self) -> CachePlan:
        cache, sched = self.config.cache, self.config.scheduler
        override = cache.num_gpu_blocks_override
        specs = self.specs + self.draft_specs
        if override is None:
            return plan_cache(specs, self.cache_budget_bytes(), cache.block_size,
                              sched.max_num_seqs, sched.max_model_len)
        # Testing knob: exactly `override` KV blocks (state slots sized as usual).
        per_seq = sum(s.bytes_per_seq for s in specs if isinstance(s, RecurrentStateSpec))
        roomy = 2 * (sched.max_num_seqs + 1) * per_seq + (override + 1) * cache.block_size * sum(
            s.bytes_per_token for s in specs if isinstance(s, PagedKVSpec))
        plan = plan_cache(specs, roomy, cache.block_size, sched.max_num_seqs, 1)
        plan = dataclasses.replace(plan, num_blocks=override)
        if plan.token_capacity < sched.max_model_len:
            raise CacheTooSmallError(f"num_gpu_blocks_override={override} holds "
                                     f"{plan.token_capacity} tokens < max_model_len="
                                     f"{sched.max_model_len}")
        return plan

    def init_cache(self, plan: CachePlan) -> None:
        self.plan = plan
        # KV left uninitialised (zeroing GiBs costs seconds at start-up): attention reads only
        # written slots, block 0 (zeroed: padding reads it) and the tail of a context's last
        # block, which the backend zeroes after its gather.
        caches = allocate_caches(self.specs, self.model, plan.num_blocks, plan.block_size,
                                 plan.num_state_slots, self.dtype, self.device, zeroed=False)
        grammars = RequestGrammars(partial(model_grammar_service, self.config.model)) \
            if self.tp.is_driver and self.config.pooler is None else None
        self.runner = ModelRunner(self.model, caches, self.backends, plan.block_size,
                                  self.device, self.tp.is_driver, self.config.seed,
                                  self.has_state, grammars, self.config.pooler,
                                  self._proposer(plan, caches), self._spec_ranks())
        if self.config.kv_transfer is not None:
            self.kv_agent = KVTransferAgent(self.config.kv_transfer, caches, plan.block_size,
                                            self.tp,
                                            self.config.model.hf_config.num_key_value_heads)
        self.runner.lockstep = self._lockstep(self.runner.proposer)
        self.runner.decode_replays = self._decode_replays(plan)

    def _decode_replays(self, plan: CachePlan) -> DecodeReplays | None:
        """Recorded decode steps where every op of one can be a native call on this platform:
        one process (no collectives), a plain dense model, no drafts or pooling."""
        max_batch = self.config.decode_replay_max_batch
        if (not max_batch or not self.platform.replays_decode_steps or self.tp.world_size > 1
                or self.runner.proposer is not None or self.runner.lockstep is not None
                or self.config.pooler is not None or not DecodeReplays.applies_to(self.model)):
            return None
        width = -(-self.config.scheduler.max_model_len // plan.block_size)
        return DecodeReplays(self.model, self.backends.attention, self.backends.recurrent, width,
                             max_batch, DECODE_REPLAY_BYTES, self.config.decode_replay_sizes)

    @property
    def has_state(self) -> bool:
        """Whether the model has recurrent-state layers (the runner builds their metadata)."""
        return any(isinstance(s, RecurrentStateSpec) for s in self.specs)

    def _spec_ranks(self) -> SpecRanks:
        """Sharded drafters (MTP and EAGLE-3 heads, a draft model at the target's TP) run on
        every rank in lock-step; n-gram lookup and a TP=1 draft model on the driver only."""
        every_rank = self.use_mtp or self.eagle3 is not None or (
            self.draft_tp is not None and self.draft_tp.world_size > 1)
        return SpecRanks(self.tp, every_rank)

    def _proposer(self, plan: CachePlan, caches: ModelCaches) -> Proposer | None:
        spec = self.config.speculative
        if spec is None or not (self.tp.is_driver or self._spec_ranks().every_rank):
            return None
        if self.eagle3 is not None:
            return Eagle3Proposer(self.mtp_head, self.model.model, caches,
                                  self.backends.attention, plan.block_size, self.device,
                                  spec.num_speculative_tokens,
                                  self.config.scheduler.max_model_len, spec.disable_by_batch_size)
        if self.use_mtp:
            return MtpProposer(self.mtp_head, caches, self.backends.attention, plan.block_size,
                               self.device, spec.num_speculative_tokens,
                               self.config.scheduler.max_model_len, spec.disable_by_batch_size)
        if self.draft_model is None:
            return NgramLookup(spec.prompt_lookup_min, spec.prompt_lookup_max,
                               spec.num_speculative_tokens, spec.disable_by_batch_size)
        # The drafter's KV: same block layout as the target's (dense drafters only).
        caches = allocate_caches(self.draft_specs, self.draft_model, plan.num_blocks,
                                 plan.block_size, 0, self.dtype, self.device, zeroed=False)
        return DraftModelProposer(self.draft_model, caches, self.backends.attention,
                                  plan.block_size, self.device, spec.num_speculative_tokens,
                                  spec.disable_by_batch_size)

    def warm_up(self) -> None:
        """Run one small prefill and one decode so the first request does not pay for kernel
        selection and first-touch page faults."""
        assert self.runner is not None and self.plan is not None
        bs = self.plan.block_size
        tokens = [0] * min(16, self.config.scheduler.max_model_len - 1,
                           self.plan.token_capacity - 1)
        block_ids = list(range(-(-(len(tokens) + 1) // bs)))
        state_slot = 1 if self.plan.num_state_slots else None
        params = SamplingParams(temperature=0.0, max_tokens=2)
        self.runner.execute(SchedulerOutput(
            new_requests=[NewRequestData("warmup", tokens, [], params, block_ids, state_slot)],
            chunks=[ScheduledChunk("warmup", tokens, 0, [], True)]))
        self.runner.execute(SchedulerOutput(
            chunks=[ScheduledChunk("warmup", [0], len(tokens), [], True)]))
        self.runner.execute(SchedulerOutput(finished_request_ids=["warmup"]))

    def _lockstep(self, proposer: Proposer | None) -> LockstepPasses | None:
        """DP x EP: the MoE passes each step runs on every replica (``dp_passes.py``)."""
        if self.dp_ep is None:
            return None
        return LockstepPasses(
            self.dp_ep, self.model,
            vote_rollback=self.has_state and self.config.speculative is not None,
            mtp=proposer if isinstance(proposer, MtpProposer) else None)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        assert self.runner is not None, "init_cache() first"
        if self.kv_agent is None:
            return self.runner.execute(sched)
        self.kv_agent.apply(sched)
        out = self.runner.execute(sched)
        self.kv_agent.collect(out, idle=sched.is_empty, tp=self.tp)
        return out

    def close(self) -> None:
        if self.kv_agent is not None:
            self.kv_agent.close()
            self.kv_agent = None
