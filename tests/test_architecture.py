"""House rules that keep the code base in shape (see DESIGN.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "qwenserve"
DEVICE_MODULES = ("torch.cuda", "torch.npu")
DEVICE_STRINGS = ("nccl", "hccl", "cuda", "npu", "torch_npu")


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


# Every module's floor: a module may import only from floors strictly below its own (or from
# its own unit, the longest key that prefixes its dotted name). Plain data sits at the bottom,
# then the device and kernel seams, models, the worker, the engine, the entry points and tools:
#     core <- engine <- entrypoints        models -> layers        never back up
# A new package gets a line here, on the floor of what it may import.
FLOORS = {
    "envs": 0,
    "json_option": 0,  # one parser for JSON-object flags
    "logger": 1,
    "multimodal.config": 1,  # the image flags, resolved (plain data)
    "kv_transfer.config": 1,  # --kv-transfer-config, parsed and checked (no torch)
    "kv_transfer.params": 2,  # a request's kv_transfer_params (plain data)
    "config": 2,  # plain frozen configs: every floor reads them
    "options": 2,  # vLLM's JSON options, parsed and checked (no torch)
    "metrics.stats": 2,  # plain statistics: core fills them
    "structured_output.params": 2,
    "structured_output.config": 2,
    "multimodal": 2,  # image placement (plain data) and preprocessing
    "quantization.schemes": 3,  # which quantization a checkpoint uses (no torch)
    "spec_decode.config": 3,  # --speculative-config parsing (no torch)
    "sampling_params": 3,
    "request": 4,
    "pooling": 4,  # what a pooling model returns, resolved from flags and config (no torch)
    "outputs": 4,
    "core": 5,  # scheduler and cache bookkeeping (no torch)
    "platforms": 5,
    "native": 5,  # compile-at-first-use C++ extensions, with a fallback
    "distributed": 5,
    "metrics": 6,
    "quantization.kernels": 6,  # int8 primitives the layers use
    "layers": 7,
    "quantization": 8,  # linear methods: implement layers' LinearMethod
    "models": 9,
    "worker.sampler": 9,  # the sampling steps the speculative verifier shares
    "spec_decode": 10,
    "kv_transfer": 10,  # P/D disaggregation: KV blocks over TCP (the worker's agent)  # proposers, the verifying (rejection) sampler, state roll-back
    "structured_output": 10,
    "worker": 11,
    "engine": 12,
    "entrypoints": 13,
    "tools": 14,
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    """The FLOORS key of a module inside qwenserve (None: the package root, which is light
    and imports everything lazily)."""
    keys = [k for k in FLOORS if module == k or module.startswith(k + ".")]
    if not keys:
        assert not module, f"qwenserve.{module} has no floor: add its package to FLOORS"
        return None
    return max(keys, key=len)


def _imported_modules(tree: ast.AST) -> list[str]:
    """qwenserve modules (relative dotted names) imported anywhere in a file, lazily and under
    TYPE_CHECKING included: a type annotation is an arrow too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "qwenserve":  # `from qwenserve import envs`: submodules
                found += [f"qwenserve.{a.name}" for a in node.names
                          if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file()]
            else:
                found.append(node.module)
    return [m.removeprefix("qwenserve.") for m in found if m.startswith("qwenserve.")]


def test_imports_point_down():
    """No arrow in the import graph runs upward (or sideways between units of one floor)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        importer = _module_name(path)
        unit = _unit(importer)
        if unit is None:
            continue
        for imported in _imported_modules(ast.parse(path.read_text())):
            target = _unit(imported)
            if target is not None and target != unit and FLOORS[target] >= FLOORS[unit]:
                offenders.append(f"{importer} (floor {FLOORS[unit]}) imports {imported} "
                                 f"(floor {FLOORS[target]})")
    assert not offenders, "\n".join(offenders)


def test_core_imports_no_torch():
    modules = sorted(_module_name(p) for p in (SRC / "core").rglob("*.py"))
    code = (f"import sys; import {', '.join('qwenserve.' + m for m in modules)}; "
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
