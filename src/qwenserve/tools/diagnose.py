"""``qwenserve diagnose [LOGFILE|-]``: name the root cause of a failed server log, and its fix.

The knowledge base is data (``diagnose_rules.yaml`` beside this file), so adding a signature never
touches code. The first match in the log wins, because a root cause (an OOM while loading) comes
before its consequences (the engine's generic "initialization failed"); rules marked ``fallback``
only describe such consequences and win only when nothing else matched. Unknown logs get the last
exception and a pointer to ``qwenserve doctor``. Exit code: 0 when a known root cause was found,
1 when none was, 2 when the log cannot be read.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import importlib.resources
import json
import re
import string
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

RULES_FILE = "diagnose_rules.yaml"
_REQUIRED = ("id", "title", "patterns", "explanation", "fix")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(
    r"^(?:.*?[\s:|)\]])?((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit)\b(?::.*)?)$", re.M
)
DOCTOR_HINT = "run `qwenserve doctor` (add --model DIR) to check this machine and the model folder"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Rule:
    id: str
    title: str
    patterns: tuple[re.Pattern[str], ...]
    explanation: str
    fix: str
    context: tuple[re.Pattern[str], ...] = ()
    context_lines: int = 40
    fallback: bool = False
    supersedes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Hit:
    rule: Rule
    line: int  # 1-based
    groups: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """``rule`` is None for an unknown log; then ``fix`` points at ``qwenserve doctor``."""

    rule: Rule | None
    line: int | None = None
    excerpt: str | None = None
    groups: dict[str, str] = dataclasses.field(default_factory=dict)
    also: tuple[tuple[str, int], ...] = ()
    last_exception: str | None = None

    @property
    def explanation(self) -> str:
        if self.rule is None:
            return "No known signature matched this log."
        return string.Template(self.rule.explanation).safe_substitute(self.groups)

    @property
    def fix(self) -> str:
        if self.rule is None:
            return DOCTOR_HINT
        return string.Template(self.rule.fix).safe_substitute(self.groups)

    def to_dict(self) -> dict[str, object]:
        rule = self.rule
        return {
            "matched": rule is not None,
            "id": rule.id if rule else None,
            "title": rule.title if rule else None,
            "line": self.line,
            "excerpt": self.excerpt,
            "explanation": self.explanation,
            "fix": self.fix,
            "also_matched": [{"id": i, "line": n} for i, n in self.also],
            "last_exception": self.last_exception,
        }


def _compile(patterns: object, rule_id: str, field: str) -> tuple[re.Pattern[str], ...]:
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{RULES_FILE}: rule {rule_id!r}: {field} must be a list of strings")
    try:
        return tuple(re.compile(p, re.MULTILINE) for p in patterns)
    except re.error as e:
        raise ValueError(f"{RULES_FILE}: rule {rule_id!r}: bad regex in {field}: {e}") from e


def parse_rules(entries: object) -> tuple[Rule, ...]:
    """Validate the YAML list and compile it; a malformed rule fails loudly, naming the rule."""
    if not isinstance(entries, list):
        raise ValueError(f"{RULES_FILE} must be a list of rules")
    rules: list[Rule] = []
    for entry in entries:
        missing = [k for k in _REQUIRED if not isinstance(entry, dict) or not entry.get(k)]
        rule_id = entry.get("id", "?") if isinstance(entry, dict) else "?"
        if missing:
            raise ValueError(f"{RULES_FILE}: rule {rule_id!r} lacks {', '.join(missing)}")
        rules.append(
            Rule(
                id=rule_id,
                title=entry["title"],
                patterns=_compile(entry["patterns"], rule_id, "patterns"),
                explanation=" ".join(entry["explanation"].split()),
                fix=" ".join(entry["fix"].split()),
                context=_compile(entry.get("context", []), rule_id, "context"),
                context_lines=int(entry.get("context_lines", 40)),
                fallback=bool(entry.get("fallback", False)),
                supersedes=tuple(entry.get("supersedes", ())),
            )
        )
    ids = [r.id for r in rules]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"{RULES_FILE}: duplicate rule ids {duplicates}")
    return tuple(rules)


@functools.lru_cache(maxsize=1)
def load_rules() -> tuple[Rule, ...]:
    text = importlib.resources.files("qwenserve.tools").joinpath(RULES_FILE).read_text()
    return parse_rules(yaml.safe_load(text))


class _Log:
    """The log text with a line index, so a match offset maps to its line number."""

    def __init__(self, text: str) -> None:
        self.text = _ANSI.sub("", text.replace("\r\n", "\n"))
        self.starts = [0] + [m.end() for m in re.finditer("\n", self.text)]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset)

    def line_text(self, line: int) -> str:
        end = self.starts[line] - 1 if line < len(self.starts) else len(self.text)
        return self.text[self.starts[line - 1] : end]

    def window(self, line: int, num_lines: int) -> str:
        first = max(1, line - num_lines + 1)
        end = self.starts[line] if line < len(self.starts) else len(self.text)
        return self.text[self.starts[first - 1] : end]


def _plain(value: str) -> str:
    """``17,536`` -> ``17536``: numbers go back into flags, which take no separators."""
    return value.replace(",", "") if re.fullmatch(r"\d{1,3}(?:,\d{3})+", value) else value


def _first_hit(rule: Rule, log: _Log) -> Hit | None:
    """The earliest place this rule matches (with its context, when it has one)."""
    best: Hit | None = None
    for pattern in rule.patterns:
        for match in pattern.finditer(log.text):
            line = log.line_of(match.start())
            if best is not None and line >= best.line:
                break
            if rule.context and not any(
                c.search(log.window(line, rule.context_lines)) for c in rule.context
            ):
                continue
            groups = {k: _plain(v) for k, v in match.groupdict().items() if v is not None}
            best = Hit(rule, line, groups)
            break
    return best


def last_exception(text: str) -> str | None:
    found = _EXCEPTION_LINE.findall(_ANSI.sub("", text))
    return found[-1].strip()[:500] if found else None


def diagnose_text(text: str, rules: Sequence[Rule] | None = None) -> Diagnosis:
    log = _Log(text)
    hits = [hit for rule in (rules or load_rules()) if (hit := _first_hit(rule, log))]
    primary = [h for h in hits if not h.rule.fallback] or hits
    if not primary:
        return Diagnosis(rule=None, last_exception=last_exception(log.text))
    order = {id(h.rule): i for i, h in enumerate(hits)}
    best = min(primary, key=lambda h: (h.line, order[id(h.rule)]))
    # A later message that explains the same failure better (qwenserve's own wrapper of an OOM).
    best = next((h for h in hits if best.rule.id in h.rule.supersedes and h.line > best.line), best)
    later = [h for h in sorted(hits, key=lambda h: h.line) if h.line != best.line]
    also = tuple((h.rule.id, h.line) for h in later)
    return Diagnosis(
        rule=best.rule,
        line=best.line,
        excerpt=log.line_text(best.line).strip()[:500],
        groups=best.groups,
        also=also,
        last_exception=last_exception(log.text),
    )


def render_text(diagnosis: Diagnosis, source: str) -> str:
    if diagnosis.rule is None:
        lines = [f"{source}: no known root cause found."]
        lines.append(f"Last exception: {diagnosis.last_exception or '(none found in the log)'}")
        lines.append(f"Next step: {DOCTOR_HINT}")
        return "\n".join(lines)
    lines = [
        f"Root cause: {diagnosis.rule.title} [{diagnosis.rule.id}]",
        f"  at {source}:{diagnosis.line}: {diagnosis.excerpt}",
        f"Why: {diagnosis.explanation}",
        f"Fix: {diagnosis.fix}",
    ]
    if diagnosis.also:
        later = ", ".join(f"{rule_id} (line {line})" for rule_id, line in diagnosis.also[:5])
        lines.append(f"Also matched: {later}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "logfile",
        nargs="?",
        default="-",
        metavar="LOGFILE|-",
        help="server log to read; '-' or nothing reads standard input",
    )
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="read at most the last N bytes of a big log (default 64 MiB)",
    )


def _read(source: str, max_bytes: int) -> str:
    if source == "-":
        return sys.stdin.read()[-max_bytes:]
    with Path(source).open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - max_bytes))
        return f.read().decode("utf-8", errors="replace")


def run(args: argparse.Namespace) -> int:
    try:
        text = _read(args.logfile, args.max_bytes)
    except OSError as e:
        print(f"qwenserve diagnose: cannot read {args.logfile}: {e.strerror or e}", file=sys.stderr)
        return 2
    diagnosis = diagnose_text(text)
    source = "<stdin>" if args.logfile == "-" else args.logfile
    if args.json:
        print(json.dumps({"source": source, **diagnosis.to_dict()}, indent=2))
    else:
        print(render_text(diagnosis, source))
    return 0 if diagnosis.rule is not None else 1
