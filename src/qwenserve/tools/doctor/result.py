"""One check's verdict, and how a list of them is printed (text for people, JSON for scripts)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import Counter
from collections.abc import Sequence


class Status(str, enum.Enum):
    """PASS/WARN/FAIL decide the exit code; SKIP says a check does not apply to this host."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclasses.dataclass(frozen=True)
class Check:
    """A verdict: ``reason`` says what was found, ``fix`` what to do (empty when nothing to do)."""

    id: str
    status: Status
    reason: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "status": self.status.value, "reason": self.reason, "fix": self.fix}


def passed(check_id: str, reason: str) -> Check:
    return Check(check_id, Status.PASS, reason)


def warn(check_id: str, reason: str, fix: str) -> Check:
    return Check(check_id, Status.WARN, reason, fix)


def fail(check_id: str, reason: str, fix: str) -> Check:
    return Check(check_id, Status.FAIL, reason, fix)


def skip(check_id: str, reason: str) -> Check:
    return Check(check_id, Status.SKIP, reason)


def exit_code(checks: Sequence[Check]) -> int:
    """0 when nothing failed (warnings do not fail a run), 1 otherwise."""
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


def summary(checks: Sequence[Check]) -> dict[str, int]:
    counts = Counter(c.status for c in checks)
    return {s.value.lower(): counts.get(s, 0) for s in Status}


def render_json(checks: Sequence[Check], platform: str) -> str:
    report = {
        "ok": exit_code(checks) == 0,
        "platform": platform,
        "summary": summary(checks),
        "checks": [c.to_dict() for c in checks],
    }
    return json.dumps(report, indent=2)


def render_text(checks: Sequence[Check], platform: str) -> str:
    width = max((len(c.id) for c in checks), default=8)
    lines = [f"qwenserve doctor (platform: {platform})", ""]
    for check in checks:
        lines.append(f"{check.status.value}  {check.id:<{width}}  {check.reason}")
        if check.fix and check.status is not Status.PASS:
            lines.append(f"{'':4}  {'':<{width}}  fix: {check.fix}")
    counts = summary(checks)
    lines.append("")
    lines.append(
        f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed, "
        f"{counts['skip']} skipped"
    )
    return "\n".join(lines)
