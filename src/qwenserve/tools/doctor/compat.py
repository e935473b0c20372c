"""The Ascend software stack rows that are known to work together, as data.

Source: vllm-ascend ``docs/source/community/versioning_policy.md`` (HEAD 182b75e), copied in
/work/shared/research/ecosystem.md section 5.1. One row per release; combined rows of the upstream
table ("v0.17.0rc1 / v0.16.0rc1") are split. The driver (HDK) pairs are observations from public
``collect_env`` dumps, not an official table, so a mismatch there is only a warning.
``deploy docker`` uses the same rows to pin torch/torch_npu for a CANN base image.
"""

from __future__ import annotations

import dataclasses

from qwenserve.tools.doctor.versions import base_version, compare, sort_key


@dataclasses.dataclass(frozen=True)
class CompatRow:
    vllm_ascend: str
    vllm: str
    python_min: str
    python_max: str  # exclusive
    cann: str
    torch: str
    torch_npu: str


# fmt: off
COMPAT_TABLE: tuple[CompatRow, ...] = (
    CompatRow("v0.23.0",      "v0.23.0", "3.10", "3.13", "9.1.0",   "2.10.0", "2.10.0.post4"),
    CompatRow("v0.23.0rc1",   "v0.23.0", "3.10", "3.13", "9.0.1",   "2.10.0", "2.10.0.post2"),
    CompatRow("v0.22.1rc1",   "v0.22.1", "3.10", "3.13", "9.0.0",   "2.10.0", "2.10.0"),
    CompatRow("v0.21.0rc1",   "v0.21.0", "3.10", "3.13", "9.0.0",   "2.10.0", "2.10.0"),
    CompatRow("v0.20.2rc1",   "v0.20.2", "3.10", "3.12", "9.0.0",   "2.10.0", "2.10.0"),
    CompatRow("v0.19.1rc1",   "v0.19.1", "3.10", "3.12", "8.5.1",   "2.9.0",  "2.9.0"),
    CompatRow("v0.18.0",      "v0.18.0", "3.10", "3.12", "8.5.1",   "2.9.0",  "2.9.0.post1"),
    CompatRow("v0.17.0rc1",   "v0.17.0", "3.10", "3.12", "8.5.1",   "2.9.0",  "2.9.0"),
    CompatRow("v0.16.0rc1",   "v0.16.0", "3.10", "3.12", "8.5.1",   "2.9.0",  "2.9.0"),
    CompatRow("v0.15.0rc1",   "v0.15.0", "3.10", "3.12", "8.5.0",   "2.9.0",  "2.9.0"),
    CompatRow("v0.14.0rc1",   "v0.14.1", "3.10", "3.12", "8.5.0",   "2.9.0",  "2.9.0"),
    CompatRow("v0.13.0",      "v0.13.0", "3.10", "3.12", "8.5.0",   "2.8.0",  "2.8.0.post2"),
    CompatRow("v0.13.0rc3",   "v0.13.0", "3.10", "3.12", "8.5.1",   "2.8.0",  "2.8.0.post2"),
    CompatRow("v0.13.0rc1",   "v0.13.0", "3.10", "3.12", "8.3.RC2", "2.8.0",  "2.8.0"),
    CompatRow("v0.12.0rc1",   "v0.12.0", "3.10", "3.12", "8.3.RC2", "2.8.0",  "2.8.0"),
    CompatRow("v0.11.0",      "v0.11.0", "3.9",  "3.12", "8.3.RC2", "2.7.1",  "2.7.1.post1"),
    CompatRow("v0.10.x rc",   "v0.10.x", "3.9",  "3.12", "8.2.RC1", "2.7.1",  "2.7.1.dev20250724"),
    CompatRow("v0.9.1",       "v0.9.1",  "3.9",  "3.12", "8.2.RC1", "2.5.1",  "2.5.1.post1"),
    CompatRow("v0.7.3",       "v0.7.3",  "3.9",  "3.12", "8.1.RC1", "2.5.1",  "2.5.1"),
)

# (CANN, npu-smi driver version) seen working together in public collect_env dumps.
OBSERVED_DRIVER_PAIRS: tuple[tuple[str, str], ...] = (
    ("8.1.RC1", "24.1.rc3.3"),
    ("8.3.RC2", "25.0.rc1.1"),
)
# fmt: on

RECOMMENDED = COMPAT_TABLE[0]


def _same(a: str, b: str) -> bool:
    return compare(a.split("+", 1)[0], b.split("+", 1)[0]) == 0


def rows_for_torch_npu(torch_npu: str) -> list[CompatRow]:
    """Rows naming this torch_npu build (a local ``+git...`` suffix is ignored)."""
    return [row for row in COMPAT_TABLE if _same(row.torch_npu, torch_npu)]


def rows_for_cann(cann: str) -> list[CompatRow]:
    return [row for row in COMPAT_TABLE if _same(row.cann, cann)]


def known_canns() -> list[str]:
    return sorted({row.cann for row in COMPAT_TABLE}, key=sort_key)


def newest_row_for_cann(cann: str) -> CompatRow | None:
    rows = rows_for_cann(cann)
    return rows[0] if rows else None


def torch_npu_pairs_with(torch_npu: str, torch: str) -> bool:
    """torch_npu X.Y.Z[.postN] is built against torch X.Y.Z and only loads into that release."""
    return base_version(torch_npu) == base_version(torch)


def min_observed_driver(cann: str) -> tuple[str, str] | None:
    """The newest observed (CANN, driver) pair whose CANN is not newer than ``cann``."""
    older = [pair for pair in OBSERVED_DRIVER_PAIRS if compare(pair[0], cann) <= 0]
    return max(older, key=lambda pair: sort_key(pair[0])) if older else None
