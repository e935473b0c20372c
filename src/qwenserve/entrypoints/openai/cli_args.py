"""``qwenserve serve`` flags: vLLM's names, defaults and ``--help`` groups.

Engine flags come from ``EngineArgs`` (one place per flag); this module adds the server's own
(``Frontend``) and logging flags, ``--config FILE.yaml`` and ``--help=<group|flag>`` as vLLM
has them, and a table of vLLM flags qwenserve knows but does not implement: those are accepted
only with their default value and otherwise refused with "not implemented yet", never ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from qwenserve.engine.arg_utils import EngineArgs, human_readable_int
from qwenserve.entrypoints.openai.cli_data_parallel import (
    add_data_parallel_flags,
    data_parallel_problem,
)
from qwenserve.entrypoints.openai.cli_help import (
    AddsArguments,
    FlagGroup,
    FlagRegistry,
    answer_help_query,
)
from qwenserve.entrypoints.openai.cli_spellings import canonical_flag_spellings
from qwenserve.entrypoints.openai.reasoning import KNOWN_VLLM_REASONING_PARSERS, REASONING_PARSERS
from qwenserve.entrypoints.openai.tool_parsers import KNOWN_VLLM_TOOL_PARSERS, TOOL_PARSERS
from qwenserve.spec_decode.config import parse_speculative_config
from qwenserve.structured_output.config import (
    fold_dotted_flags,
    parse_structured_outputs_config,
)

BOOL = argparse.BooleanOptionalAction
# flag (+ aliases), argparse kwargs, the values that are no-ops here (None: not given)
UNIMPLEMENTED: tuple[tuple[tuple[str, ...], dict[str, Any], tuple[Any, ...]], ...] = (
    (("--uds",), {}, (None,)),
    (("--kv-cache-dtype",), {}, (None, "auto")),
    (("--pipeline-parallel-size", "-pp"), {"type": int}, (None, 1)),
    (("--distributed-executor-backend",), {}, (None, "mp", "uni")),
    (("--enable-chunked-prefill",), {"action": BOOL}, (None, True)),
    (("--scheduling-policy",), {}, (None, "fcfs")),
    (("--tokenizer-mode",), {}, (None, "auto", "hf")),
    (("--cpu-offload-gb",), {"type": float}, (None, 0.0)),
    (("--enable-lora",), {"action": BOOL}, (None, False)),
    (("--lora-modules",), {"nargs": "+"}, (None,)),
    (("--guided-decoding-backend",), {}, (None,)),
    (("--tool-parser-plugin",), {}, (None,)),
    (("--reasoning-parser-plugin",), {}, (None,)),
    (("--return-tokens-as-token-ids",), {"action": BOOL}, (None, False)),
    (("--enable-sleep-mode",), {"action": BOOL}, (None, False)),
    (("--safetensors-load-strategy",), {}, (None, "lazy")),  # qwenserve maps shards lazily
    # qwenserve always manages a hybrid model's KV blocks and state slots together
    (("--disable-hybrid-kv-cache-manager",), {"action": BOOL}, (None, False)),
)


# Other ``vllm serve`` flags: qwenserve has no equivalent, so they are refused by name ("not
# implemented yet") rather than with argparse's bare "unrecognized arguments".
VLLM_ONLY_FLAGS = frozenset(
    """
    --all2all-backend --calculate-kv-scales
    --code-revision --collect-detailed-traces --config-format --cpu-offload-params
    --cuda-graph-sizes --data-parallel-backend
    --decode-context-parallel-size --disable-cascade-attn --disable-custom-all-reduce
    --disable-frontend-multiprocessing
    --disable-sliding-window --enable-dbo --enable-eplb
    --enable-log-outputs --enable-lora-bias --enable-multimodal-encoder-data-parallel
    --enable-prompt-embeds --enable-server-load-tracking --enable-ssl-refresh
    --enable-tokenizer-info-endpoint --exclude-tools-when-tool-choice-none --fully-sharded-loras
    --h11-max-header-count --h11-max-incomplete-event-size --hf-config-path --hf-token
    --ignore-patterns --kv-events-config --log-config-file
    --log-error-stack --logits-processors --logprobs-mode --long-prefill-token-threshold
    --max-cpu-loras --max-long-partial-prefills --max-lora-rank
    --max-loras --max-num-partial-prefills --max-parallel-loading-workers
    --max-seq-len-to-capture --middleware --mm-encoder-tp-mode
    --model-impl --model-loader-extra-config --num-lookahead-slots
    --num-scheduler-steps --otlp-traces-endpoint --override-pooler-config --pooler-config
    --preemption-mode --prefix-caching-hash-algo --pt-load-map-location
    --ray-workers-use-nsight --rope-scaling --rope-theta --scheduler-cls
    --skip-tokenizer-init --ssl-ca-certs --ssl-cert-reqs --stream-interval
    --tokenizer-revision --tokens-only --tool-server --use-tqdm-on-load --worker-cls
    --worker-extension-cls
    """.split()
)


HELP_EPILOG = (
    "For full list:            {prog} --help=all\n"
    "For the groups:           {prog} --help=listgroup\n"
    "For a section:            {prog} --help=ModelConfig    (case-insensitive)\n"
    "For a flag:               {prog} --help=max-model-len  (_ or - accepted)\n"
)


def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {value!r} ({e})") from e


_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
_STORE = {"action": "store_true", "default": False}
# The ``Frontend`` group: (flag, argparse kwargs incl. help), in vLLM's order where it has them.
FRONTEND_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--host", {"help": "Host to bind (default: all interfaces)."}),
    ("--port", {"type": int, "default": 8000, "help": "Port to listen on."}),
    (
        "--uvicorn-log-level",
        {
            "default": "info",
            "choices": _LOG_LEVELS,
            "help": "Log level of uvicorn (the HTTP server).",
        },
    ),
    ("--disable-uvicorn-access-log", {**_STORE, "help": "No uvicorn line per HTTP request."}),
    ("--allow-credentials", {**_STORE, "help": "CORS: allow credentials."}),
    ("--allowed-origins", {"type": _json, "default": ["*"], "help": "CORS origins (JSON)."}),
    ("--allowed-methods", {"type": _json, "default": ["*"], "help": "CORS methods (JSON)."}),
    ("--allowed-headers", {"type": _json, "default": ["*"], "help": "CORS headers (JSON)."}),
    (
        "--api-key",
        {
            "nargs": "+",
            "help": "Require one of these keys (Authorization: Bearer "
            "KEY) on /v1 routes. Default: QWENSERVE_API_KEY or VLLM_API_KEY.",
        },
    ),
    (
        "--served-model-name",
        {
            "nargs": "+",
            "help": "Names clients use for the model; the "
            "first is reported in responses and metrics (default: the model "
            "argument).",
        },
    ),
    (
        "--chat-template",
        {"help": "Chat template: a Jinja file or the template text (default: the model's)."},
    ),
    (
        "--chat-template-content-format",
        {
            "default": "auto",
            "choices": ["auto", "string", "openai"],
            "help": "How message content reaches the template: auto/string join text parts into "
            "one string; openai keeps the list of parts.",
        },
    ),
    (
        "--trust-request-chat-template",
        {**_STORE, "help": "Allow requests to carry their own chat_template."},
    ),
    (
        "--default-chat-template-kwargs",
        {
            "type": _json,
            "help": "Template kwargs for every request, e.g. "
            "'{\"enable_thinking\": false}'; a request's own win.",
        },
    ),
    ("--response-role", {"default": "assistant", "help": "Role of generated messages."}),
    (
        "--enable-auto-tool-choice",
        {**_STORE, "help": "Parse tool calls from model output (needs --tool-call-parser)."},
    ),
    (
        "--tool-call-parser",
        {"help": f"Tool-call format: {', '.join(TOOL_PARSERS)} (Qwen2.5/Qwen3/QwQ)."},
    ),
    ("--enable-request-id-headers", {**_STORE, "help": "Echo X-Request-Id in responses."}),
    (
        "--enable-prompt-tokens-details",
        {**_STORE, "help": "Report usage.prompt_tokens_details.cached_tokens."},
    ),
    (
        "--enable-force-include-usage",
        {**_STORE, "help": "Send a usage chunk at the end of every stream."},
    ),
    ("--disable-fastapi-docs", {**_STORE, "help": "Do not serve /docs and /redoc."}),
    ("--ssl-keyfile", {"help": "TLS key file."}),
    ("--ssl-certfile", {"help": "TLS certificate file."}),
    ("--root-path", {"help": "ASGI root_path behind a path-based proxy."}),
    (
        "--max-log-len",
        {
            "type": int,
            "default": 500,
            "help": "Longest prompt text (characters) shown in request log lines (qwenserve's "
            "default: 500; vLLM's logs whole prompts).",
        },
    ),
    (
        "--max-request-body-bytes",
        {
            "type": human_readable_int,
            "default": 32 << 20,
            "help": "Larger request bodies get 413 (qwenserve; default 32M).",
        },
    ),
    (
        "--max-sequences-per-request",
        {
            "type": int,
            "default": 512,
            "help": "Most sequences (prompts x n) one request may ask for; more is a 400 "
            "(qwenserve; default 512).",
        },
    ),
    (
        "--max-queued-sequences",
        {
            "type": int,
            "default": 4096,
            "help": "Most sequences waiting for a batch slot (beyond --max-num-seqs running); a "
            "request that would pass it gets 429 (qwenserve; default 4096).",
        },
    ),
    (
        "--shutdown-timeout",
        {
            "type": float,
            "default": 30.0,
            "help": "On SIGTERM/SIGINT, seconds to let running requests finish "
            "before aborting them (0: abort at once, vLLM's "
            "default).",
        },
    ),
    ("--config", {"help": "YAML file of flags (keys are flag names); command-line flags win."}),
)


def _add_frontend(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Frontend")
    for flag, kwargs in FRONTEND_FLAGS:
        group.add_argument(flag, **{"default": None, **kwargs})


def _add_engine_extras(parser: ServeArgumentParser) -> None:
    model = parser.group("ModelConfig")
    model.add_argument(
        "--override-generation-config",
        type=_json,
        default=None,
        help="Override default sampling values, e.g. '{\"temperature\": 0.5}'.",
    )
    cache = parser.group("CacheConfig")
    cache.add_argument(
        "--swap-space",
        type=float,
        default=None,
        help="Ignored, as in vLLM V1 (preempted requests are recomputed).",
    )
    out = parser.add_argument_group("StructuredOutputsConfig")
    out.add_argument(
        "--reasoning-parser",
        default=None,
        help=f"Reasoning format: {', '.join(REASONING_PARSERS)} (Qwen3 -> qwen3, "
        "QwQ -> deepseek_r1).",
    )
    out.add_argument(
        "--structured-outputs-config",
        default=None,
        help="JSON, or dotted (--structured-outputs-config.backend xgrammar): backend "
        "(auto|xgrammar), disable_any_whitespace, enable_in_reasoning.",
    )
    out.add_argument(
        "--enable-reasoning",
        action="store_true",
        help="Deprecated in vLLM and ignored: --reasoning-parser is enough.",
    )
    obs = parser.add_argument_group("ObservabilityConfig")
    obs.add_argument(
        "--disable-log-stats", action="store_true", help="No periodic throughput/KV log line."
    )
    obs.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="No log line per request (qwenserve logs one by default).",
    )
    obs.add_argument(
        "--enable-log-requests", action="store_true", help="Log one line per request (the default)."
    )
    obs.add_argument(
        "--show-hidden-metrics-for-version",
        default=None,
        help="Also export metrics vLLM deprecated (vllm:gpu_cache_usage_perc, "
        "vllm:time_per_output_token_seconds).",
    )


def _add_unimplemented(parser: argparse.ArgumentParser) -> None:
    listed = ", ".join(names[0] for names, _, _ in UNIMPLEMENTED)
    about = (
        f"vLLM flags qwenserve accepts only at their default (or no-op) value: {listed}. "
        f"Refused whatever their value: {', '.join(sorted(VLLM_ONLY_FLAGS))}."
    )
    # The help formatter keeps descriptions raw (for the epilog), so wrap this one here.
    g = parser.add_argument_group(
        "Not implemented yet", textwrap.fill(about, 78, break_on_hyphens=False)
    )
    for names, kwargs, _ in UNIMPLEMENTED:
        g.add_argument(*names, default=None, help=argparse.SUPPRESS, **kwargs)


class ServeArgumentParser(argparse.ArgumentParser):
    """The ``serve`` parser: reads ``--config FILE``, answers ``--help=<group|flag>``, folds
    dotted flags, refuses vLLM-only flags by name and validates the result, on every parse
    (also as the ``qwenserve serve`` subparser: ``cli.py`` creates it with this class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags = FlagRegistry()
        self._built = False  # argparse makes its own two default groups while initialising
        super().__init__(*args, **kwargs)
        self._built = True

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*name_or_flags, **kwargs)
        self.flags.actions.append(action)
        return action

    def add_argument_group(self, title: str | None = None, description: str | None = None,
                           **kwargs: Any) -> AddsArguments:
        """A ``FlagGroup`` per title (the same one when asked again), so ``--help=<group>``
        can list its flags; argparse's own default groups pass through untouched."""
        if not self._built or title is None:
            return super().add_argument_group(title, description, **kwargs)
        if title not in self.flags.groups:
            group = super().add_argument_group(title, description, **kwargs)
            self.flags.groups[title] = FlagGroup(title, description, group, self.flags)
        return self.flags.groups[title]

    def group(self, title: str) -> FlagGroup:
        """The argument group named ``title`` (added by ``EngineArgs.add_cli_args``)."""
        return self.flags.groups[title]

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = canonical_flag_spellings(list(sys.argv[1:] if args is None else args))
        argv = fold_dotted_flags(argv, "--structured-outputs-config")
        argv = fold_dotted_flags(argv, "--compilation-config")
        argv = fold_dotted_flags(argv, "--speculative-config")
        argv = fold_dotted_flags(argv, "--limit-mm-per-prompt")
        query = next((a.split("=", 1)[1] for a in argv if a.startswith("--help=")), None)
        if query is not None:
            answer_help_query(self, self.flags, query, _refused_flags())
        config_argv, config_model = read_config(self, argv)
        if config_argv:  # parsed on their own first, so a list value cannot swallow argv's model
            namespace, _ = super().parse_known_args(config_argv, namespace)
        ns, extra = super().parse_known_args(argv, namespace)
        if config_model is not None and ns.model_tag is None and ns.model is None:
            ns.model = config_model  # the YAML's model, unless the command line names one
        for arg in extra:
            if arg.split("=", 1)[0] in VLLM_ONLY_FLAGS:
                self.error(f"{arg.split('=', 1)[0]} is not implemented yet in qwenserve; remove it")
        problem = validate_args(ns)
        if problem:
            self.error(problem)
        return ns, extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All ``serve`` flags on ``parser``, a ``ServeArgumentParser`` (the ``qwenserve serve``
    subparser or a fresh one)."""
    if not isinstance(parser, ServeArgumentParser):
        raise TypeError("serve flags need a ServeArgumentParser (it validates them on parse)")
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="Model folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct).",
    )
    _add_frontend(parser)
    EngineArgs.add_cli_args(parser)
    _add_engine_extras(parser)
    add_data_parallel_flags(parser.group("ParallelConfig"))
    _add_unimplemented(parser)
    parser.epilog = HELP_EPILOG.format(prog=parser.prog)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def make_serve_parser() -> ServeArgumentParser:
    parser = ServeArgumentParser(
        prog="qwenserve serve",
        allow_abbrev=False,
        description="Start the OpenAI-compatible API server.",
    )
    add_arguments(parser)
    return parser


# ---- parsing: --config, --help=..., validation -------------------------------------------------
def read_config(parser: ServeArgumentParser, argv: list[str]) -> tuple[list[str], str | None]:
    """``--config FILE`` -> (its flags as argv, its ``model``), both empty without ``--config``.

    The caller parses the file's flags first and the command line on top, so command-line flags
    win. The model is kept apart, as vLLM does, so that a model named on the command line
    (positional or ``--model``) wins over it instead of clashing."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    if path is None:
        return [], None
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    model = data.pop("model", None)
    return config_to_argv(parser, data), None if model is None else str(model)


def config_to_argv(parser: ServeArgumentParser, data: dict[str, Any]) -> list[str]:
    known = parser.flags.option_strings()
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known:
            parser.error(f"--config: unknown option {key!r}")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + flag[2:] in known:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _refused_flags() -> list[str]:
    return [*VLLM_ONLY_FLAGS, *(n for names, _, _ in UNIMPLEMENTED for n in names)]


def validate_args(ns: argparse.Namespace) -> str | None:
    """The first problem with the flags, worded with the fix; None when they are usable."""
    for names, _, accepted in UNIMPLEMENTED:
        value = getattr(ns, names[0].lstrip("-").replace("-", "_"), None)
        if value not in accepted:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            return f"{names[0]} {shown} is not implemented yet in qwenserve; remove it"
    if problem := data_parallel_problem(ns):
        return problem
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        return f"the model is given twice ({ns.model_tag} and --model {ns.model}); give it once"
    if ns.tool_call_parser and ns.tool_call_parser not in TOOL_PARSERS:
        if ns.tool_call_parser in KNOWN_VLLM_TOOL_PARSERS:
            return (
                f"--tool-call-parser {ns.tool_call_parser} is not implemented yet in "
                f"qwenserve; available: {', '.join(TOOL_PARSERS)}"
            )
        return f"--tool-call-parser {ns.tool_call_parser}: unknown; use {', '.join(TOOL_PARSERS)}"
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        return "--enable-auto-tool-choice requires --tool-call-parser"
    try:
        structured = parse_structured_outputs_config(ns.structured_outputs_config)
        parse_speculative_config(ns.speculative_config)
    except ValueError as e:
        return str(e)
    if structured.reasoning_parser and not ns.reasoning_parser:
        ns.reasoning_parser = structured.reasoning_parser  # vLLM's other spelling
    if ns.reasoning_parser and ns.reasoning_parser not in REASONING_PARSERS:
        known = ns.reasoning_parser in KNOWN_VLLM_REASONING_PARSERS
        what = "is not implemented yet in qwenserve" if known else "is unknown"
        return (
            f"--reasoning-parser {ns.reasoning_parser} {what}; available: "
            f"{', '.join(REASONING_PARSERS)}"
        )
    if ns.default_chat_template_kwargs is not None and not isinstance(
        ns.default_chat_template_kwargs, dict
    ):
        return "--default-chat-template-kwargs must be a JSON object"
    if ns.override_generation_config is not None and not isinstance(
        ns.override_generation_config, dict
    ):
        return "--override-generation-config must be a JSON object"
    if ns.max_sequences_per_request < 1:
        return "--max-sequences-per-request must be >= 1"
    if ns.max_queued_sequences < 0:
        return "--max-queued-sequences must be >= 0"
    if ns.max_log_len is not None and ns.max_log_len < 0:
        return "--max-log-len must be >= 0 characters"
    if ns.shutdown_timeout < 0:
        return "--shutdown-timeout must be >= 0 seconds"
    return None
