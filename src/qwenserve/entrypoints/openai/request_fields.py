"""Every request field vLLM's ``/v1/completions`` and ``/v1/chat/completions`` accept, in one
table: honoured by qwenserve, or refused with a 400 that names it. None is silently ignored.

A refused field is accepted at its vLLM default (clients that always send it keep working) and
refused at any other value. Fields vLLM does not know are ignored with a warning, as vLLM does;
the older ``guided_*`` fields, which vLLM removed, are refused with their replacement named.
docs/serving.md lists the same table (a test keeps the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwenserve.entrypoints.openai.errors import bad_request
from qwenserve.entrypoints.openai.protocol import OpenAIBaseModel

CHAT, COMPLETION, BOTH = ("chat",), ("completion",), ("chat", "completion")


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[str, ...]
    honoured: bool
    default: Any = None  # refused fields: the value still accepted
    note: str = ""


def _h(name: str, endpoints: tuple[str, ...] = BOTH, note: str = "") -> RequestField:
    return RequestField(name, endpoints, True, note=note)


def _r(name: str, endpoints: tuple[str, ...] = BOTH, default: Any = None,
       note: str = "") -> RequestField:
    return RequestField(name, endpoints, False, default, note)


FIELDS: tuple[RequestField, ...] = (
    _h("model"),
    _h("messages", CHAT),
    _h("prompt", COMPLETION, "text, token ids, or lists of either"),
    _h("frequency_penalty"),
    _h("presence_penalty"),
    _h("repetition_penalty"),
    _h("logit_bias", note="token id -> bias in [-100, 100], added to the logits"),
    _h("logprobs"),
    _h("top_logprobs", CHAT),
    _h("prompt_logprobs"),
    _h("max_tokens"),
    _h("max_completion_tokens", CHAT),
    _h("min_tokens"),
    _h("n"),
    _h("seed"),
    _h("stop"),
    _h("stop_token_ids"),
    _h("include_stop_str_in_output"),
    _h("ignore_eos"),
    _h("stream"),
    _h("stream_options"),
    _h("temperature"),
    _h("top_p"),
    _h("top_k"),
    _h("min_p"),
    _h("skip_special_tokens"),
    _h("spaces_between_special_tokens"),
    _h("echo", COMPLETION),
    _h("user", note="metadata only, as in vLLM"),
    _h("add_special_tokens"),
    _h("truncate_prompt_tokens", note="keep the last k prompt tokens; -1: max_model_len"),
    _h("truncation_side", note="left (default) keeps the end of the prompt, right its start"),
    _h("allowed_token_ids"),
    _h("bad_words"),
    _h("response_format", note="text, json_object, json_schema"),
    _h("structured_outputs", note="json, regex, choice, grammar (EBNF), json_object, "
                                  "structural_tag; xgrammar"),
    _h("thinking_token_budget", note="needs --reasoning-parser"),
    _h("request_id", note="the response id is <prefix>-<request_id>"),
    _h("tools", CHAT),
    _h("tool_choice", CHAT, "none, auto, required, or a named function"),
    _h("parallel_tool_calls", CHAT, "false: at most one call"),
    _h("reasoning_effort", CHAT, "passed to the chat template"),
    _h("include_reasoning", CHAT),
    _h("add_generation_prompt", CHAT),
    _h("continue_final_message", CHAT),
    _h("documents", CHAT),
    _h("chat_template", CHAT, "needs --trust-request-chat-template"),
    _h("chat_template_kwargs", CHAT),
    _r("priority", default=0, note="priority scheduling is not enabled (qwenserve schedules "
                                  "first come, first served)"),
    _r("suffix", COMPLETION, note="fill-in-the-middle suffixes are not implemented"),
    _r("echo", CHAT, False, "the chat endpoint does not echo the prompt yet"),
    _r("use_beam_search", default=False, note="beam search is not implemented"),
    _r("length_penalty", default=1.0, note="beam search only"),
    _r("watermarking", note="not implemented"),
    _r("logprob_token_ids", note="not implemented"),
    _r("prompt_embeds", COMPLETION, note="prompt embeddings are not implemented"),
    _r("media_io_kwargs", CHAT, note="per-request media I/O settings are not implemented"),
    _h("mm_processor_kwargs", CHAT, "min_pixels / max_pixels / size of the image processor"),
    _r("mm_payload", note="send images as chat image_url parts"),
    _r("return_mm_kwargs", default=False, note="returning processed image inputs is not implemented"),
    _r("session_id", note="sessions are not implemented"),
    _r("return_tokens_as_token_ids", default=False, note="not implemented"),
    _r("return_token_ids", default=False, note="not implemented"),
    _r("return_token_offsets", default=False, note="not implemented"),
    _r("return_prompt_text", CHAT, False, "not implemented"),
    _r("routed_experts_prompt_start", note="not implemented"),
    _r("cache_salt", note="prefix-cache salting is not implemented"),
    _h("kv_transfer_params", note="prefill/decode disaggregation: needs --kv-transfer-config "
       "(docs/disaggregation.md)"),
    _r("ec_transfer_params", note="encoder-cache transfer is not implemented"),
    _r("vllm_xargs", note="custom logits-processor arguments are not implemented"),
    _r("repetition_detection", note="not implemented"),
    _r("stream_interval", default=1, note="every token is streamed"),
)

# Removed from vLLM (replaced by ``structured_outputs``): refused with the replacement named.
REMOVED_FIELDS = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": "--structured-outputs-config",
    "guided_whitespace_pattern": "structured_outputs.disable_any_whitespace",
    "structural_tag": "structured_outputs.structural_tag",
}


def fields_for(endpoint: str) -> dict[str, RequestField]:
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


def refuse_unsupported(req: OpenAIBaseModel, endpoint: str) -> None:
    """400 for a refused field set to anything but its default, or a removed guided_* field."""
    extra = req.model_extra or {}
    for field in fields_for(endpoint).values():
        if field.honoured:
            continue
        value = getattr(req, field.name, extra.get(field.name, field.default))
        if value is not None and value != field.default:
            raise bad_request(f"{field.name} is not supported by qwenserve: {field.note}",
                              field.name)
    for name, replacement in REMOVED_FIELDS.items():
        if extra.get(name) is not None:
            raise bad_request(f"{name} was removed from vLLM's API; use {replacement}", name)


def unknown_fields(req: OpenAIBaseModel, endpoint: str) -> list[str]:
    """Fields neither vLLM nor qwenserve knows (ignored with a warning, as vLLM does)."""
    known = fields_for(endpoint)
    return [name for name in req.ignored_fields() if name not in known]
