"""RequestChecks: what makes the engine refuse a request, checkable without the model.

The server runs these in its own process before a request crosses to the engine process, so a
bad request is a 400 at once; the engine runs them again when it adds the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwenserve.config import EngineConfig
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.sampling_params import SamplingParams
from qwenserve.structured_output.service import GrammarService, model_grammar_service

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptTooLongError(ValueError):
    """The prompt does not fit ``max_model_len`` (vLLM's wording, so clients can match it)."""


class RequestChecks:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._grammars: GrammarService | None = None

    def truncate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """``truncate_prompt_tokens``: keep the last k tokens (-1: as many as fit). The prompt
        the engine runs, which its outputs name (``AsyncEngine`` restores it from here)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = self.config.scheduler.max_model_len if k == -1 else k
        return prompt_token_ids[-k:]

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams,
                         compile_grammar: bool = True) -> None:
        """Raise ``ValueError`` (400 in the server) before the request reaches the scheduler.
        With ``compile_grammar`` a structured-output spec is compiled now (blocking; cached)."""
        self.check_prompt(prompt_token_ids)
        if params.pooling != (self.config.pooler is not None):
            raise ValueError(
                "this server runs a pooling model (--runner pooling): use /v1/embeddings, "
                "/score or /rerank, or serve it without --runner pooling to generate text"
                if self.config.pooler is not None else
                "this model generates text; embeddings and scores need --runner pooling "
                "(an embedding or reranker model)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name} {value} is more than the engine's max_logprobs "
                                 f"({self.config.max_logprobs}); ask for fewer or raise "
                                 "--max-logprobs")
        vocab = self.config.model.vocab_size
        for name, ids in (("allowed_token_ids", params.allowed_token_ids or []),
                          ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has out-of-vocabulary token id {bad[0]} (the "
                                 f"vocabulary has {vocab} tokens)")
        self.check_kv_transfer(params)
        if compile_grammar and params.structured_outputs is not None:
            self.grammar_service().compile(params.structured_outputs.to_spec())

    def check_kv_transfer(self, params: SamplingParams) -> None:
        """``kv_transfer_params`` only where ``--kv-transfer-config`` gives this role."""
        kv = params.kv_transfer_params
        if kv is None:
            return
        config = self.config.kv_transfer
        if config is None:
            raise ValueError("kv_transfer_params needs a server started with "
                             "--kv-transfer-config (prefill/decode disaggregation)")
        if kv.do_remote_decode and not config.is_producer:
            raise ValueError(f"kv_transfer_params.do_remote_decode: this server is a "
                             f"{config.role}; send prefill requests to a kv_producer")
        if kv.remote is not None and not config.is_consumer:
            raise ValueError(f"kv_transfer_params.do_remote_prefill: this server is a "
                             f"{config.role}; send decode requests to a kv_consumer")
        if params.n != 1:
            raise ValueError("kv_transfer_params with n > 1 is not implemented yet")
        if params.prompt_logprobs is not None and kv.remote is not None:
            raise ValueError("prompt_logprobs cannot be computed on a decode instance (the "
                             "prompt was prefilled elsewhere); ask the prefill instance")

    @property
    def takes_images(self) -> bool:
        """A vision tower is built and images are not disabled."""
        return self.config.model.has_vision and self.config.multimodal.image_limit > 0

    def check_images(self, prompt_token_ids: list[int], mm_inputs: MultiModalInputs | None,
                     params: SamplingParams) -> None:
        """Images only for a model that takes them, with every placeholder filled, untruncated."""
        if mm_inputs is None:
            image_token = getattr(self.config.model.hf_config, "image_token_id", None)
            if self.takes_images and image_token in prompt_token_ids:
                raise ValueError("the prompt has image placeholder tokens but no images were "
                                 "given; pass the images (multi_modal_data / image parts)")
            return
        if not self.takes_images:
            raise ValueError(self.images_refused_reason())
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images (it could cut "
                             "an image's tokens)")
        if params.kv_transfer_params is not None:
            raise ValueError("kv_transfer_params with images is not implemented yet")

    def images_refused_reason(self) -> str:
        return images_refused_reason(self.config)

    def grammar_service(self) -> GrammarService:
        """The process's grammar compiler for this model (built on first use: xgrammar loads
        only when a request asks for structured outputs)."""
        if self._grammars is None:
            self._grammars = model_grammar_service(self.config.model, self.tokenizer)
        return self._grammars

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        max_len = self.config.scheduler.max_model_len
        if not prompt_token_ids:
            raise ValueError("The prompt is empty; give at least one token")
        if len(prompt_token_ids) > max_len:
            raise PromptTooLongError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {max_len}. Make sure that `max_model_len` is no smaller than "
                "the number of text tokens.")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {vocab})")


def images_refused_reason(config: EngineConfig) -> str:
    """Why this engine refuses images (the 400's message)."""
    mc, mm = config.model, config.multimodal
    if mm.language_model_only:
        return "image inputs are disabled: the server runs with --language-model-only"
    if mc.has_vision:
        return "image inputs are disabled on this server (--limit-mm-per-prompt '{\"image\": 0}')"
    return f"{mc.name} is a text-only model; it does not take image inputs"
