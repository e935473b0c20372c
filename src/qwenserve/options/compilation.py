"""``--compilation-config`` / ``-cc``: vLLM's CompilationConfig, validated by its field names.

vLLM uses it for ``torch.compile`` (``mode``, inductor settings) and for graph capture
(``cudagraph_mode``, capture sizes: CUDA graphs on GPUs, ACL graphs on Ascend through vLLM
Ascend). qwenserve's counterpart on CPU records decode-only steps and replays their native
kernel calls (worker/decode_replay.py): ``cudagraph_mode`` NONE switches that off (as
``--enforce-eager`` does), ``max_cudagraph_capture_size`` is the largest batch it records and
``cudagraph_capture_sizes`` the batch sizes it records (others run eagerly: CUDA graphs pad a
batch up to the next captured size, a recorded CPU step does not).
Every other given key is logged once at start-up with what it does in vLLM and why it has no
effect here. Unknown keys and malformed values are errors, as in vLLM (its config forbids extra
fields).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qwenserve.json_option import json_object_option

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")

_GRAPHS = "graph capture (CUDA graphs on GPUs, ACL graphs on Ascend)"
_COMPILE = "torch.compile"
# vLLM's field -> (what it controls in vLLM, the kind of check on its value)
FIELDS: dict[str, tuple[str, str]] = {
    "level": (f"{_COMPILE} level (deprecated name of mode)", "mode"),
    "mode": (f"{_COMPILE} mode 0-3", "mode"),
    "debug_dump_path": (f"where {_COMPILE} dumps debug files", "str"),
    "cache_dir": (f"{_COMPILE} cache folder", "str"),
    "compile_cache_save_format": (f"{_COMPILE} cache format", "str"),
    "backend": (f"{_COMPILE} backend", "str"),
    "custom_ops": ("which custom ops run instead of compiled code", "list"),
    "splitting_ops": ("ops left out of piecewise graphs", "list"),
    "compile_mm_encoder": (f"{_COMPILE} of the vision encoder", "bool"),
    "compile_sizes": ("batch sizes inductor compiles for", "list"),
    "compile_ranges_split_points": ("inductor compile ranges", "list"),
    "inductor_compile_config": ("inductor options", "dict"),
    "inductor_passes": ("extra inductor passes", "dict"),
    "use_inductor": ("inductor on/off (deprecated)", "bool"),
    "use_inductor_graph_partition": ("inductor graph partition", "bool"),
    "pass_config": ("fusion passes", "dict"),
    "dynamic_shapes_config": (f"{_COMPILE} dynamic shapes", "dict"),
    "cudagraph_mode": (_GRAPHS + " mode", "cudagraph_mode"),
    "cudagraph_capture_sizes": (_GRAPHS + ": batch sizes captured", "sizes"),
    "max_cudagraph_capture_size": (_GRAPHS + ": largest batch captured", "int"),
    "cudagraph_num_of_warmups": (_GRAPHS + ": warm-up runs", "int"),
    "cudagraph_copy_inputs": (_GRAPHS + ": copy inputs to static buffers", "bool"),
    "cudagraph_specialize_lora": (_GRAPHS + ": separate graphs with LoRA", "bool"),
    "full_cuda_graph": (_GRAPHS + ": full graphs (deprecated)", "bool"),
    "use_cudagraph": (_GRAPHS + " on/off (deprecated)", "bool"),
}


# The decode batches recorded by default: vLLM's default largest CUDA-graph batch is 512; on CPU
# the recordings keep their activations (~0.5 MiB a sequence on the Qwen2.5-0.5B shape), so
# fewer. Steps of more sequences than this are Python-light per token anyway.
DEFAULT_DECODE_REPLAY_MAX_BATCH = 256
# What all recorded decode steps' buffers may hold together (worker/decode_replay.py): a batch-64
# step of the Qwen2.5-0.5B shape keeps ~33 MiB of activations, a batch-1 step ~0.6 MiB.
DECODE_REPLAY_BYTES = 256 << 20
# the keys that act where a platform replays decode steps (Platform.replays_decode_steps)
ACTING_KEYS = ("cudagraph_mode", "max_cudagraph_capture_size", "cudagraph_capture_sizes")


@dataclass(frozen=True)
class CompilationConfig:
    """The keys the user gave, validated (vLLM's defaults apply to the rest)."""

    given: dict[str, Any] = field(default_factory=dict)

    def decode_replay_max_batch(self, enforce_eager: bool) -> int:
        """The largest decode batch replayed from a recording; 0: none (``--enforce-eager``,
        ``cudagraph_mode`` NONE)."""
        if enforce_eager or self.given.get("cudagraph_mode") == "NONE":
            return 0
        sizes = self.given.get("cudagraph_capture_sizes")
        default = max(sizes) if sizes else DEFAULT_DECODE_REPLAY_MAX_BATCH
        return self.given.get("max_cudagraph_capture_size", default)

    def decode_replay_sizes(self) -> tuple[int, ...]:
        """The batch sizes recorded (``cudagraph_capture_sizes``); empty: every size up to
        ``decode_replay_max_batch``."""
        return tuple(sorted(set(self.given.get("cudagraph_capture_sizes") or ())))

    def startup_notes(self, platform_name: str, replays_decode_steps: bool) -> list[str]:
        """One line per given key: what it does here (the keys that act where the platform
        replays decode steps), or what it does in vLLM and why it has no effect here."""
        notes = []
        for key, value in self.given.items():
            given = f"--compilation-config {key}={json.dumps(value)}"
            if key in ACTING_KEYS and replays_decode_steps:
                notes.append(f"{given}: {_acting_note(key, value, platform_name)}")
                continue
            what = FIELDS[key][0]
            if _COMPILE in what:
                why = "qwenserve does not use torch.compile yet (it runs the model eagerly)"
            elif replays_decode_steps:
                why = (f"on {platform_name} qwenserve records and replays decode-only steps of "
                       "the batch sizes cudagraph_capture_sizes names (default: every size up "
                       "to max_cudagraph_capture_size); this key has no counterpart there")
            else:
                why = f"qwenserve has no graph capture on {platform_name} yet (steps run eagerly)"
            notes.append(f"{given} ({what}): no effect on {platform_name}: {why}")
        return notes


def _acting_note(key: str, value: Any, platform_name: str) -> str:
    if key == "max_cudagraph_capture_size":
        return f"the largest decode batch recorded and replayed on {platform_name}"
    if key == "cudagraph_capture_sizes":
        return (f"the decode batch sizes recorded and replayed on {platform_name}; steps of "
                "other sizes run eagerly (CUDA graphs pad a batch up to a captured size, a "
                "recorded step is not padded)")
    if value == "NONE":
        return "every step runs eagerly (no recorded decode steps), as --enforce-eager"
    return (f"decode-only steps are recorded once per batch size and replayed on "
            f"{platform_name} (vLLM's FULL_DECODE_ONLY; steps with prefill rows run eagerly)")


def compilation_config_arg(text: str) -> dict[str, Any]:
    """argparse type: a JSON object, or a bare mode number (``-O3``, ``-cc 3``)."""
    import argparse

    try:
        return parse_compilation_config(text).given
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse_compilation_config(value: Any) -> CompilationConfig:
    """A JSON string, an already-parsed dict (``-cc.key=value`` folded), or None."""
    if value is None:
        return CompilationConfig()
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():  # vLLM's ``-O3`` / ``--compilation-config 3``: the mode
            return parse_compilation_config({"mode": int(text)})
        value = text
    value = json_object_option("--compilation-config", value)
    given = {}
    for key, raw in value.items():
        if key not in FIELDS:
            raise ValueError(f"--compilation-config: unknown key {key!r}; vLLM's keys are "
                             f"{', '.join(FIELDS)}")
        given[key] = _check(key, _decode(raw), FIELDS[key][1])
    return CompilationConfig(given)


def _decode(raw: Any) -> Any:
    """Dotted flags (``-cc.cudagraph_capture_sizes=[1,2]``) arrive as text: read JSON in it."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _check(key: str, value: Any, kind: str) -> Any:
    bad = f"--compilation-config: {key}={value!r} "
    if kind == "cudagraph_mode":
        if str(value).upper() not in CUDAGRAPH_MODES:
            raise ValueError(bad + "is not a cudagraph mode; use one of "
                             + ", ".join(CUDAGRAPH_MODES))
        return str(value).upper()
    if kind == "mode":
        names = {n: i for i, n in enumerate(COMPILATION_MODES)}
        if isinstance(value, str) and value.upper() in names:
            return names[value.upper()]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
            raise ValueError(bad + f"is not a compilation mode; use 0-3 or {', '.join(names)}")
        return value
    if kind == "sizes":
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise ValueError(bad + "must be a list of positive integers, e.g. [1, 2, 4, 8]")
        return sorted(set(value))
    expected = {"int": int, "bool": bool, "str": str, "list": list, "dict": dict}[kind]
    if not isinstance(value, expected) or (kind == "int" and isinstance(value, bool)):
        raise ValueError(bad + f"must be a {expected.__name__}")
    if kind == "int" and value < 0:  # a batch size or a count (0: none)
        raise ValueError(bad + "must be 0 or more")
    return value
