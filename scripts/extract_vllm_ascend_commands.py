"""Extract every complete ``vllm serve`` command from vLLM Ascend's Qwen model tutorials.

Usage: ``python scripts/extract_vllm_ascend_commands.py GIT_DIR > OUT.json`` where GIT_DIR is a
clone (or bare git dir) of github.com/vllm-project/vllm-ascend. The output feeds
``tests/entrypoints/openai/test_vllm_ascend_corpus.py``: each command with its file and line, and
the commit it was read at. A command is the ``vllm serve`` line plus its backslash continuations
(and lines inside an open quote, for multi-line JSON), cut at a shell operator (``&``, ``|``,
``>``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

TUTORIALS = "docs/source/tutorials/models/"
FILES = (
    "Qwen3-Dense.md Qwen3-30B-A3B.md Qwen3-235B-A22B.md Qwen3-Coder-30B-A3B.md Qwen3-Next.md "
    "Qwen3.5-Dense.md Qwen3.5-27B-Qwen3.6-27B.md Qwen3.5-397B-A17B.md Qwen3.6-35B-A3B.md "
    "Qwen3.8-27B.md Qwen3.8-2.4T-A95B.md Qwen-VL-Dense.md Qwen3-VL-30B-A3B-Instruct.md "
    "Qwen3-VL-235B-A22B-Instruct.md Qwen3-Embedding.md Qwen3-Reranker.md Qwen2.5-Math-RM-72B.md"
).split()
SHELL_STOPS = ("&", "&&", "|", ">", ">>", "2>&1", ";")


def _complete(cmd: str) -> bool:
    try:
        shlex.split(cmd)
        return True
    except ValueError:  # an open quote: the command goes on
        return False


def commands_in(text: str) -> list[tuple[int, str]]:
    """(1-based line, command) for each ``vllm serve`` command in a markdown file."""
    lines = text.splitlines()
    found: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = re.search(r"\bvllm serve\b", lines[i])
        prose = lines[i].lstrip().startswith(("#", "-", "*", ">")) or "`vllm serve" in lines[i]
        if m and not prose:
            start, cmd = i + 1, lines[i][m.start():]
            while (cmd.rstrip().endswith("\\") or not _complete(cmd)) and i + 1 < len(lines):
                i += 1
                if lines[i].strip().startswith("#") and _complete(cmd):
                    continue  # a comment line between continuations
                head = cmd.rstrip()[:-1] if cmd.rstrip().endswith("\\") else cmd
                cmd = head + " " + lines[i].strip()
            argv = shlex.split(cmd)
            for stop in SHELL_STOPS:
                if stop in argv:
                    argv = argv[: argv.index(stop)]
            found.append((start, shlex.join(argv)))
        i += 1
    return found


def main(git_dir: str) -> None:
    def git(*args: str) -> str:
        return subprocess.check_output(["git", "--git-dir", git_dir, *args], text=True)

    commit = git("rev-parse", "HEAD").strip()
    out = [
        {"file": TUTORIALS + name, "line": line, "command": cmd}
        for name in FILES
        for line, cmd in commands_in(git("show", f"HEAD:{TUTORIALS}{name}"))
    ]
    json.dump({"source": "https://github.com/vllm-project/vllm-ascend", "commit": commit,
               "commands": out}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
