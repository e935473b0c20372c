"""``qwenserve chat``: talk to a model in the terminal, offline (no server).

Takes the same engine flags as ``qwenserve serve``; with no model it runs the embedded
SmolLM2-135M-Instruct. Replies stream as they are generated. Commands: ``/reset`` forgets the
conversation, ``/system TEXT`` sets the system prompt, ``/exit`` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from qwenserve.engine.arg_utils import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="Model folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct).",
    )
    g = parser.add_argument_group("Chat")
    g.add_argument("--system", default=None, help="System prompt.")
    g.add_argument("--max-tokens", type=int, default=512, help="Longest reply in tokens.")
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="Sampling temperature (default: the model's generation_config).",
    )
    g.add_argument("--chat-template", default=None, help="Chat template file or text.")
    g.add_argument(
        "--chat-template-kwargs", default=None, help="JSON, e.g. '{\"enable_thinking\": false}'."
    )
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        session = ChatSession(args)
    except Exception as e:  # noqa: BLE001 - one clean line instead of a traceback
        print(f"error: cannot start: {e}", file=sys.stderr)
        return 1
    interactive = stdin.isatty()
    if interactive:
        print(f"Chatting with {session.model_name}. /reset, /system TEXT, /exit.", file=stdout)
    while True:
        if interactive:
            print(">>> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        session.handle(line.rstrip("\n"), stdout)


class ChatSession:
    """A conversation with one engine; each reply streams token by token."""

    def __init__(self, args: argparse.Namespace) -> None:
        import json

        from qwenserve.entrypoints.chat_utils import load_chat_template
        from qwenserve.entrypoints.llm import LLM

        engine_args = EngineArgs.from_cli_args(args)
        kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
        self.llm = LLM(args.model_tag or engine_args.model, **kwargs)
        self.model_name = self.llm.llm_engine.config.model.name
        self.system = args.system
        self.max_tokens = args.max_tokens
        self.temperature = args.temperature
        self.template = load_chat_template(args.chat_template)
        self.template_kwargs = json.loads(args.chat_template_kwargs or "{}")
        self.history: list[dict[str, str]] = []
        self._turn = 0

    def handle(self, line: str, out: TextIO) -> None:
        if line.strip() == "/reset":
            self.history = []
            print("(conversation cleared)", file=out)
        elif line.startswith("/system"):
            self.system = line[len("/system") :].strip() or None
            self.history = []
            print("(system prompt set; conversation cleared)", file=out)
        elif line.strip():
            self.history.append({"role": "user", "content": line})
            reply = self.reply(out)
            self.history.append({"role": "assistant", "content": reply})

    def reply(self, out: TextIO) -> str:
        from qwenserve.entrypoints.chat_utils import apply_chat_template
        from qwenserve.sampling_params import RequestOutputKind, SamplingParams

        messages = (
            [{"role": "system", "content": self.system}] if self.system else []
        ) + self.history
        ids = apply_chat_template(
            self.llm.get_tokenizer(), messages, self.template, **self.template_kwargs
        )
        defaults: dict[str, Any] = self.llm._default_sampling()
        if self.temperature is not None:
            defaults["temperature"] = self.temperature
        defaults["max_tokens"] = self.max_tokens
        params = SamplingParams(**defaults, output_kind=RequestOutputKind.DELTA)
        engine = self.llm.llm_engine
        self._turn += 1
        engine.add_request(f"chat-{self._turn}", ids, params)
        text = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                delta = output.outputs[0].text
                text += delta
                print(delta, end="", file=out, flush=True)
        print(file=out)
        return text
