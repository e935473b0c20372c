"""Request fields that constrain the output -> ``StructuredOutputsParams`` for the engine.

- OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs``
  (only one of the two per request);
- ``tool_choice``: a named function constrains the output to that tool's arguments schema;
  ``"required"`` to a JSON array of calls whose ``parameters`` validate against their tool
  (``parallel_tool_calls: false``: exactly one). ``tool_parsers/forced.py`` reads them back;
- with a reasoning parser, the constraint starts once the reasoning block closes (the gate
  tokens go in ``SamplingParams.reasoning_end_token_ids``), as vLLM does.

Grammars compile on the engine's thread pool; ``check_grammar`` awaits that compile so that a
bad schema, regex or grammar is a 400 naming the problem before the request is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from qwenserve.entrypoints.openai.errors import bad_request
from qwenserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    SamplingRequest,
    StructuredOutputsRequest,
)
from qwenserve.entrypoints.openai.reasoning import REASONING_PARSERS
from qwenserve.entrypoints.openai.reasoning.qwen3 import prompt_opens_block
from qwenserve.sampling_params import SamplingParams
from qwenserve.structured_output.backend import GrammarError
from qwenserve.structured_output.params import StructuredOutputsParams


def request_constraint(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it (for error messages)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", _from_response_format(fmt.type, fmt.json_schema)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_vllm(req.structured_outputs)))
    if isinstance(req, ChatCompletionRequest) and (tool := _from_tool_choice(req)) is not None:
        found.append(("tool_choice", tool))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} both constrain the output; give only one", found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _from_response_format(kind: str, json_schema: dict[str, Any] | None
                          ) -> StructuredOutputsParams:
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = (json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request('response_format json_schema needs "json_schema": {"name": ..., '
                              '"schema": {...}}', "response_format")
        return StructuredOutputsParams(json=schema)
    raise bad_request(f"response_format {kind!r} is not supported by qwenserve; use "
                      "structured_outputs.structural_tag", "response_format")


def _from_vllm(body: StructuredOutputsRequest) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(
            json=body.json_, regex=body.regex, choice=body.choice, grammar=body.grammar,
            json_object=body.json_object, structural_tag=body.structural_tag,
            disable_any_whitespace=body.disable_any_whitespace,
            disable_additional_properties=body.disable_additional_properties,
            whitespace_pattern=body.whitespace_pattern)
    except ValueError as e:
        raise bad_request(str(e), "structured_outputs") from e


def forced_tool_name(req: ChatCompletionRequest) -> str | None:
    """The function a named ``tool_choice`` forces, or None."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return None
    name = choice.function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request('tool_choice needs {"type": "function", "function": {"name": ...}}',
                          "tool_choice")
    return name


def _from_tool_choice(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    tools = {t.function.name: t.function.parameters or {"type": "object"}
             for t in req.tools or []}
    name = forced_tool_name(req)
    if name is not None:
        if name not in tools:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools "
                              f"({', '.join(tools) or 'none'})", "tool_choice")
        return StructuredOutputsParams(json=tools[name])
    if req.tool_choice != "required" or not tools:
        return None
    call_schemas = [{"type": "object",
                     "properties": {"name": {"type": "string", "enum": [tool]},
                                    "parameters": schema},
                     "required": ["name", "parameters"]} for tool, schema in tools.items()]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def reasoning_gate(state: Any, prompt_text: str | None) -> list[int] | None:
    """With a reasoning parser, the end tag's tokens when the prompt leaves a block open (the
    output starts inside it); None when the output starts outside reasoning."""
    name = state.options.reasoning_parser
    if not name:
        return None
    parser = REASONING_PARSERS[name]
    if not (parser.implicit_start or prompt_opens_block(prompt_text, parser.start_tag,
                                                          parser.end_tag)):
        return None
    return list(state.tokenizer.encode(parser.end_tag, add_special_tokens=False))


def apply_constraints(state: Any, req: SamplingRequest, params: SamplingParams,
                      prompt_text: str | None) -> str | None:
    """Set the request's constraint, gate and thinking budget on ``params`` (400s as vLLM);
    returns the field that set the constraint."""
    constraint, source = request_constraint(req)
    config = state.options.structured_outputs
    if constraint is not None and config.disable_any_whitespace:
        constraint = dataclasses.replace(constraint, disable_any_whitespace=True)
    params.structured_outputs = constraint
    params.thinking_token_budget = req.thinking_token_budget
    if req.thinking_token_budget is not None and not state.options.reasoning_parser:
        raise bad_request("thinking_token_budget is set but reasoning is not configured; start "
                          "the server with --reasoning-parser", "thinking_token_budget")
    budget = params.thinking_token_budget is not None
    if constraint is not None or budget:
        gate = reasoning_gate(state, prompt_text)
        params.reasoning_end_token_ids = None if config.enable_in_reasoning and not budget \
            else gate
    return source


async def check_grammar(state: Any, params_list: list[SamplingParams], source: str | None
                        ) -> None:
    """Compile each request's grammar off the event loop (cached); a bad one is a 400."""
    for params in params_list:
        if params.structured_outputs is None:
            continue
        future = state.grammar_service().submit(params.structured_outputs.to_spec())
        try:
            await asyncio.wrap_future(future)
        except GrammarError as e:
            raise bad_request(str(e), source or "structured_outputs") from e
