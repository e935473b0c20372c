"""LLMEngine: add requests, step, get outputs. The loop both the offline LLM and the server run.

    add_request -> Scheduler (waiting) -> step(): schedule -> execute -> update -> detokenize
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from qwenserve import envs, platforms
from qwenserve.config import DataParallelRank, EngineConfig
from qwenserve.core.cache.manager import CacheManager
from qwenserve.core.sched_output import SchedulerOutput
from qwenserve.core.scheduler import Scheduler
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.executor import make_executor
from qwenserve.engine.output_processor import OutputProcessor
from qwenserve.engine.request_checks import PromptTooLongError, RequestChecks
from qwenserve.logger import init_logger
from qwenserve.metrics.stats import EngineStats, FinishedRequestStats, IterationStats
from qwenserve.models.tokenizer import load_tokenizer
from qwenserve.multimodal.front import ImageInputs
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.outputs import RequestOutput
from qwenserve.request import Request, RequestStatus
from qwenserve.sampling_params import SamplingParams
from qwenserve.spec_decode.config import mtp_lookahead_tokens
from qwenserve.structured_output.service import GrammarService

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qwenserve.distributed.parallel_group import ParallelGroup
    from qwenserve.platforms.base import Platform

logger = init_logger(__name__)

__all__ = ["LLMEngine", "PromptTooLongError"]  # the error's old home, kept for importers


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: list[Any] | None = None,
                 platform: Platform | None = None) -> None:
        """``platform``: the one ``config`` was resolved on (default: by its name)."""
        start = time.perf_counter()
        self.config = config
        mc = config.model
        self.tokenizer = load_tokenizer(mc)
        self.executor = make_executor(config, platform or platforms.resolve_platform(config.platform_name))
        self.plan = self.executor.plan_cache()
        self.executor.init_cache(self.plan)
        self.cache = CacheManager(self.plan.num_blocks, config.cache.block_size,
                                  config.cache.enable_prefix_caching, self.plan.num_state_slots,
                                  mtp_lookahead_tokens(config.speculative),
                                  config.scheduler.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.cache, config.kv_transfer,
                                   config.parallel.tensor_parallel_size)
        self.scheduler.remote.hold_timeout_s = envs.kv_hold_timeout_s()
        self._failures: list[tuple[str, str]] = []  # (request id, why) since the last take
        self.outputs = OutputProcessor(self.tokenizer)
        self.checks = RequestChecks(config, self.tokenizer)
        self.image_inputs = ImageInputs.for_engine(config, self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._pending_aborts: list[FinishedRequestStats] = []
        # Structured-output requests whose grammar is still compiling: (future, parent id,
        # children). They reach the scheduler once it is ready, so they never stall others.
        self._awaiting_grammar: list[tuple[Future, str, list[Request]]] = []
        self.startup_s = time.perf_counter() - start
        self._log_startup()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, data_parallel: DataParallelRank | None = None,
                         **kwargs: Any) -> LLMEngine:
        """The engine's entry point: the platform is resolved here, once, and passed down.
        ``data_parallel``: this replica's rank in the MoE group over the replicas (DP x EP)."""
        platform = platforms.resolve_platform()
        config = args.create_engine_config(platform)
        if data_parallel is not None:
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                config.parallel, data_parallel=data_parallel))
        return cls(config, platform=platform, **kwargs)

    @property
    def dp_group(self) -> ParallelGroup | None:
        """The MoE group over data-parallel replicas (DP x EP): the engine core steps in lock
        with the other replicas when there is one."""
        return self.executor.dp_group

    def execute_dummy_batch(self) -> None:
        """A step with no tokens of this replica's own, while other replicas step (DP x EP):
        its MoE layers still take part in the exchange."""
        self.executor.execute(SchedulerOutput())

    def _log_startup(self) -> None:
        mc, sched = self.config.model, self.config.scheduler
        logger.info("Model %s (%s) loaded in %.1f s: %s, %.2f GiB of weights on %s",
                    mc.name, mc.architecture, self.executor.load_s, mc.dtype,
                    self.executor.weight_bytes() / 2**30, self.executor.describe_device())
        logger.info(self.plan.summary(sched.max_model_len))
        if self.cache.enable_prefix_caching and self.plan.num_state_slots:
            logger.info("Prefix caching on a hybrid model: recurrent-state checkpoints at block "
                        "boundaries are kept in the state slots no running sequence holds")
        logger.info("Engine ready in %.1f s (max_model_len=%d, max_num_seqs=%d, "
                    "max_num_batched_tokens=%d, prefix caching %s)", self.startup_s,
                    sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens,
                    "on" if self.cache.enable_prefix_caching else "off")

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    mm_inputs: MultiModalInputs | None = None) -> None:
        """Queue a request (``arrival_time`` is ``time.monotonic()``-based). A prompt with images
        comes expanded, with its ``mm_inputs`` (``ImageInputs.prepare``)."""
        if self.outputs.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.checks.check_images(prompt_token_ids, mm_inputs, params)
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params)
        self.validate_request(prompt_token_ids, params, compile_grammar=False)
        params = self._finalize_params(params)
        grammar = None
        if params.structured_outputs is not None:  # compiled off this thread (cached by spec)
            grammar = self.grammar_service().submit(params.structured_outputs.to_spec())
            if grammar.done() and grammar.exception() is not None:
                raise ValueError(str(grammar.exception()))
        max_len = self.config.scheduler.max_model_len
        room = max(max_len - len(prompt_token_ids), 1)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for child_id in self.outputs.add_request(request_id, prompt, prompt_token_ids, params,
                                                 arrival):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + int(child_id.split("_", 1)[0]))
            children.append(Request(child_id, list(prompt_token_ids), child_params, max_tokens,
                                    arrival_time=arrival, mm_inputs=mm_inputs))
        if grammar is not None and not grammar.done():
            self._awaiting_grammar.append((grammar, request_id, children))
            return
        for req in children:
            self.scheduler.add_request(req)

    def truncate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        return self.checks.truncate_prompt(prompt_token_ids, params)

    def check_images(self, prompt_token_ids: list[int], mm_inputs: MultiModalInputs | None,
                     params: SamplingParams) -> None:
        self.checks.check_images(prompt_token_ids, mm_inputs, params)

    def images_refused_reason(self) -> str:
        return self.checks.images_refused_reason()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams,
                         compile_grammar: bool = True) -> None:
        self.checks.validate_request(prompt_token_ids, params, compile_grammar)

    def grammar_service(self) -> GrammarService:
        return self.checks.grammar_service()

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        self.checks.check_prompt(prompt_token_ids)

    def _finalize_params(self, params: SamplingParams) -> SamplingParams:
        params = params.clone()
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids |= set(self.config.model.eos_token_ids)
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the model may write it: alone, and after a space (as vLLM)."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._awaiting_grammar = [w for w in self._awaiting_grammar if w[1] != request_id]
            children = self.outputs.abort(request_id)
            for req in self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED):
                self._pending_aborts.append(FinishedRequestStats(
                    "abort", time.monotonic() - req.arrival_time, 0.0, 0.0, 0.0,
                    req.num_prompt_tokens, req.num_output_tokens, req.max_tokens))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_grammar)

    def has_kv_holds(self) -> bool:
        """P/D producer: finished requests' blocks wait for a consumer; a step frees those
        pulled (or timed out) since the last one."""
        return bool(self.scheduler.remote.held)

    def take_failures(self) -> list[tuple[str, str]]:
        """Requests that failed after they were accepted (a KV pull), with why."""
        failures, self._failures = self._failures, []
        return failures

    def get_num_unfinished_requests(self) -> int:
        waiting_grammar = sum(len(children) for _, _, children in self._awaiting_grammar)
        pulling = len(self.scheduler.remote.pulling) - len(self.scheduler.remote.aborted_pulls)
        return (len(self.scheduler.waiting) + len(self.scheduler.running) + pulling
                + waiting_grammar)

    def _admit_compiled(self) -> None:
        """Hand requests whose grammar is ready to the scheduler. With nothing else to run, wait
        a little for a compile instead of spinning."""
        if not self._awaiting_grammar:
            return
        if not self.scheduler.has_unfinished_requests():
            wait_futures([f for f, _, _ in self._awaiting_grammar], timeout=0.05,
                         return_when=FIRST_COMPLETED)
        still = []
        for future, request_id, children in self._awaiting_grammar:
            if not future.done():
                still.append((future, request_id, children))
            elif future.exception() is not None:  # the server checks specs first: not expected
                logger.error("Request %s: %s; aborted", request_id, future.exception())
                self.outputs.abort(request_id)
            else:
                for req in children:
                    self.scheduler.add_request(req)
        self._awaiting_grammar = still

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit_compiled()
        sched_out = self.scheduler.schedule()
        model_out = self.executor.execute(sched_out)
        updates = self.scheduler.update(sched_out, model_out)
        for request_id, why in self.scheduler.take_failures():  # n == 1: child id == its id
            logger.error("Request %s failed: %s", request_id, why)
            self.outputs.abort(request_id)
            self._failures.append((request_id, why))
        stats = IterationStats(num_scheduled_tokens=sched_out.num_scheduled_tokens,
                               spec_decoding=self.scheduler.take_spec_stats())
        outputs, stopped = self.outputs.process(updates, stats)
        for child_id, stop in stopped.items():
            self.scheduler.finish_requests([child_id], RequestStatus.FINISHED_STOPPED, stop)
        stats.finished.extend(self._pending_aborts)
        self._pending_aborts = []
        self._record(stats)
        return outputs

    def record_idle_stats(self) -> None:
        """Report gauges and pending aborts when the engine goes idle: no step follows an abort
        of the last request, and its freed blocks must still show in the metrics."""
        stats = IterationStats()
        stats.finished.extend(self._pending_aborts)
        self._pending_aborts = []
        self._record(stats)

    def _record(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        s = self.scheduler.stats()
        engine_stats = EngineStats(**vars(s), iteration=iteration)
        for stat_logger in self.stat_loggers:
            stat_logger.record(engine_stats)

    def reset_prefix_cache(self) -> bool:
        return self.cache.reset_prefix_cache()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def shutdown(self) -> None:
        self.executor.shutdown()
