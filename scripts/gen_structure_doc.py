"""Regenerate the module tables of docs/structure.md from the package's docstrings.

The hand-written overview above the first table is kept; run after adding or renaming modules:

    python scripts/gen_structure_doc.py
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "qwenserve"
DOC = ROOT / "docs" / "structure.md"
MARKER = "\n## qwenserve/\n"
MAX_SUMMARY = 150


def summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        return "(package marker)" if path.name == "__init__.py" else "(no docstring)"
    first = " ".join(doc.split("\n\n")[0].split())
    return first if len(first) <= MAX_SUMMARY else first[:MAX_SUMMARY - 3] + "..."


def tables() -> str:
    groups: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        groups[rel.parts[0] if len(rel.parts) > 1 else ""].append(rel)
    out = []
    for group in sorted(groups):
        out.append(f"## qwenserve/{group + '/' if group else ''}\n")
        out.append("| module | lines | what it is |\n|---|---|---|")
        for rel in groups[group]:
            path = PACKAGE / rel
            lines = len(path.read_text().splitlines())
            out.append(f"| `{rel.as_posix()}` | {lines} | {summary(path).replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    text = DOC.read_text()
    head = text.split(MARKER)[0] if MARKER in text else text.split("\n## (package)\n")[0]
    DOC.write_text(head.rstrip("\n") + "\n\n" + tables())


if __name__ == "__main__":
    main()
