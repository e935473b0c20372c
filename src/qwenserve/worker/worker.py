"""Worker: one device's share of the model: load, size the cache, allocate it, run steps."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from qwenserve.config import EngineConfig
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
from qwenserve.layers.backends import Backends
from qwenserve.logger import init_logger
from qwenserve.models.base import ModelContext
from qwenserve.models.loader import iter_weights
from qwenserve.models.registry import load_model_class
from qwenserve.sampling_params import SamplingParams
from qwenserve.structured_output.request_grammars import RequestGrammars
from qwenserve.structured_output.service import model_grammar_service
from qwenserve.worker.caches import allocate_caches
from qwenserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from qwenserve.platforms.base import Platform
    from qwenserve.quantization.quant_config import QuantConfig

logger = init_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    def __init__(self, config: EngineConfig, platform: Platform, tp: ParallelGroup = SINGLE,
                 local_rank: int = 0):
        self.config = config
        self.tp = tp
        self.platform = platform
        self.platform.configure_process()
        self.device = self.platform.device(local_rank)
        self.dtype = _DTYPES[config.model.dtype]
        self.model_cls = load_model_class(config.model.architecture)
        self.backends = Backends.for_platform(platform)  # the kernels, chosen once
        self.specs = self.model_cls.cache_specs(config.model.hf_config, tp.world_size,
                                                self.dtype.itemsize)
        self.model: Any = None
        self.runner: ModelRunner | None = None
        self.plan: CachePlan | None = None
        self.load_s = 0.0

    # ---- start-up -----------------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        mc = self.config.model
        ctx = ModelContext(hf_config=mc.hf_config, dtype=self.dtype,
                           max_model_len=mc.max_model_len, tp=self.tp,
                           backends=self.backends, quant=self._quant())
        try:
            with torch.device(self.device):
                model = self.model_cls(ctx)
            model.load_weights(iter_weights(mc.source, mc.hf_config),
                               mc.source.gguf_file or mc.source.folder)
            if ctx.quant is not None:  # scales per shard -> per layer, folded biases
                ctx.quant.process_weights_after_loading(model)
        except torch.OutOfMemoryError as e:
            raise MemoryError(
                f"Not enough device memory to load the weights of {mc.name} in {mc.dtype} on "
                f"{self.device}. Use more devices (--tensor-parallel-size), a quantized "
                "checkpoint (--quantization), or a smaller model."
            ) from e
        self.model = model.eval()
        self.load_s = time.perf_counter() - start

    def _quant(self) -> QuantConfig | None:
        if self.config.model.quantization is None:
            return None
        from qwenserve.quantization import build_quant_method

        return build_quant_method(self.config.model, self.backends.int8_mm)

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
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
        if override is None:
            return plan_cache(self.specs, self.cache_budget_bytes(), cache.block_size,
                              sched.max_num_seqs, sched.max_model_len)
        # Testing knob: exactly `override` KV blocks (state slots sized as usual).
        per_seq = sum(s.bytes_per_seq for s in self.specs if isinstance(s, RecurrentStateSpec))
        roomy = 2 * (sched.max_num_seqs + 1) * per_seq + (override + 1) * cache.block_size * sum(
            s.bytes_per_token for s in self.specs if isinstance(s, PagedKVSpec))
        plan = plan_cache(self.specs, roomy, cache.block_size, sched.max_num_seqs, 1)
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
            if self.tp.is_driver else None
        self.runner = ModelRunner(self.model, caches, self.backends, plan.block_size,
                                  self.device, self.tp.is_driver, self.config.seed,
                                  self.has_state, grammars)

    @property
    def has_state(self) -> bool:
        """Whether the model has recurrent-state layers (the runner builds their metadata)."""
        return any(isinstance(s, RecurrentStateSpec) for s in self.specs)

    def warm_up(self) -> None:
        """Run one small prefill and one decode so the first request does not pay for kernel
        selection and first-touch page faults."""
        assert self.runner is not None and self.plan is not None
        bs = self.plan.block_size
        tokens = [0] * min(16, self.config.scheduler.max_model_len - 1,
                           self.plan.token_capacity - 1)
        block_ids = list(range(-(-(len(tokens) + 1) // bs)))
        slot = 1 if self.plan.num_state_slots else None
        params = SamplingParams(temperature=0.0, max_tokens=2)
        self.runner.execute(SchedulerOutput(
            new_requests=[NewRequestData("warmup", tokens, [], params, block_ids, slot)],
            chunks=[ScheduledChunk("warmup", tokens, 0, [], True)]))
        self.runner.execute(SchedulerOutput(
            chunks=[ScheduledChunk("warmup", [0], len(tokens), [], True)]))
        self.runner.execute(SchedulerOutput(finished_request_ids=["warmup"]))

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        assert self.runner is not None, "init_cache() first"
        return self.runner.execute(sched)
