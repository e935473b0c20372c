"""House rules that keep the code base in shape (see DESIGN.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "qwenserve"
DEVICE_MODULES = ("torch.cuda", "torch.npu")
DEVICE_STRINGS = ("nccl", "hccl")


def _device_uses(tree: ast.AST) -> list[str]:
    """Code (not comments or docs) that names a device runtime."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith(DEVICE_MODULES):
            found.append(ast.unparse(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [n for n in names if n.startswith("torch_npu")]
        elif isinstance(node, ast.Constant) and node.value in DEVICE_STRINGS:
            found.append(repr(node.value))
    return found


def test_core_imports_no_torch():
    code = ("import sys, qwenserve.core.scheduler, qwenserve.core.cache.manager, "
            "qwenserve.core.cache.plan, qwenserve.core.sched_output; "
            "assert 'torch' not in sys.modules, 'core imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_import_is_light():
    code = "import sys, qwenserve; assert 'torch' not in sys.modules and 'transformers' " \
           "not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_device_names_only_in_platforms():
    """Engine code reaches devices through the Platform seam. (``tools/doctor`` inspects the
    device software by name on purpose, so it is exempt.)"""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("platforms", "tools"):
            continue
        offenders += [f"{rel}: {n}" for n in _device_uses(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_no_global_statements():
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not offenders, offenders


def test_files_stay_small():
    big = [f"{p.relative_to(SRC)} ({n} lines)" for p in SRC.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 600]
    assert not big, big
