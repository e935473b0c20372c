"""Parse the ``npu-smi info`` table.

Each NPU takes two rows (sample from an Atlas 800 A2, vllm-ascend#5021)::

    | 1     910B2               | OK            | 95.7        44                0    / 0             |
    | 0                         | 0000:01:00.0  | 0           0    / 0          61258/ 65536         |

Row 1: NPU id, name, health, power, temperature, hugepages. Row 2: chip (A3 adds a Phy-ID and
two chips per NPU), bus id, AICore %, host memory used/total and HBM used/total, where numbers may
run into the slash (``61258/ 65536``). After the devices comes the process table::

    | 1       0                 | 30336         | python                   | 3790                    |
"""

from __future__ import annotations

import dataclasses
import re

_HEADER = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")
_ROW1 = re.compile(r"^\|\s*(\d+)\s+([\w.\-]+)\s*\|\s*([A-Za-z]+)\s*\|")
_ROW2 = re.compile(
    r"^\|\s*(\d+)(?:\s+\d+)?\s*\|\s*([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s*\|(.*)\|"
)
_PROCESS = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|\s*(\d+)\s*\|\s*(.*?)\s*\|\s*(\d+)\s*\|")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


@dataclasses.dataclass(frozen=True)
class NpuChip:
    npu_id: int
    chip_id: int
    name: str
    health: str
    hbm_used_mb: int
    hbm_total_mb: int


@dataclasses.dataclass(frozen=True)
class NpuProcess:
    npu_id: int
    chip_id: int
    pid: int
    name: str
    memory_mb: int


@dataclasses.dataclass(frozen=True)
class NpuSmiInfo:
    version: str | None
    chips: tuple[NpuChip, ...]
    processes: tuple[NpuProcess, ...]

    def processes_on(self, npu_id: int) -> list[NpuProcess]:
        return [p for p in self.processes if p.npu_id == npu_id]


def parse_npu_smi(text: str) -> NpuSmiInfo:
    version = None
    chips: list[NpuChip] = []
    processes: list[NpuProcess] = []
    current: tuple[int, str, str] | None = None  # (npu id, name, health) of the last row 1
    in_processes = False
    for line in text.splitlines():
        header = _HEADER.search(line)
        if header:
            version = header.group(2)
        elif "Process id" in line:
            in_processes = True
        elif in_processes:
            process = _parse_process(line)
            if process:
                processes.append(process)
        elif (row1 := _ROW1.match(line)) is not None:
            current = (int(row1.group(1)), row1.group(2), row1.group(3))
        elif current is not None and (row2 := _ROW2.match(line)) is not None:
            chips.append(_make_chip(current, int(row2.group(1)), row2.group(3)))
    return NpuSmiInfo(version=version, chips=tuple(chips), processes=tuple(processes))


def _make_chip(row1: tuple[int, str, str], chip_id: int, usage_cell: str) -> NpuChip:
    pairs = _PAIR.findall(usage_cell)
    used, total = (int(pairs[-1][0]), int(pairs[-1][1])) if pairs else (0, 0)
    npu_id, name, health = row1
    return NpuChip(npu_id, chip_id, name, health, used, total)


def _parse_process(line: str) -> NpuProcess | None:
    match = _PROCESS.match(line)
    if not match:
        return None
    npu_id, chip_id, pid, name, memory = match.groups()
    return NpuProcess(int(npu_id), int(chip_id), int(pid), name, int(memory))
