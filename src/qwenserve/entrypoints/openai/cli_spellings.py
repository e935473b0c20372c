"""Flag spellings vLLM's ``FlexibleArgumentParser`` accepts, rewritten to the canonical ones
before parsing: ``--max_model_len`` -> ``--max-model-len`` (underscores in the flag name, not in a
dotted key or a value), ``-cc.key=value`` -> ``--compilation-config.key=value`` and ``-O3`` ->
``--compilation-config 3`` (the compilation mode)."""

from __future__ import annotations

import re

_SHORT_DOTTED = {"-cc.": "--compilation-config."}


def canonical_flag_spellings(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        for short, long in _SHORT_DOTTED.items():
            if arg.startswith(short):
                arg = long + arg[len(short):]
        if m := re.fullmatch(r"-O(\d)", arg):
            out += ["--compilation-config", m[1]]
            continue
        if arg.startswith("--") and len(arg) > 2:
            name, sep, rest = _split_name(arg[2:])
            arg = "--" + name.replace("_", "-") + sep + rest
        out.append(arg)
    return out


def _split_name(text: str) -> tuple[str, str, str]:
    """``name``, the separator (``.`` of a dotted key or ``=`` of a value) and what follows."""
    cut = min((i for i in (text.find("."), text.find("=")) if i >= 0), default=len(text))
    return text[:cut], text[cut : cut + 1], text[cut + 1 :]
