"""Device presets (memory as the device reports it) and quantization widths."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class DevicePreset:
    name: str
    memory_bytes: int
    kind: str  # "npu" | "cuda" | "cpu"
    bf16: bool = True


DEVICES = {
    "910b-64g": DevicePreset("Ascend 910B 64 GB", 65536 * MIB, "npu"),
    "910b-32g": DevicePreset("Ascend 910B 32 GB", 32768 * MIB, "npu"),
    "a100-80g": DevicePreset("NVIDIA A100 80 GB", 81920 * MIB, "cuda"),
    "a100-40g": DevicePreset("NVIDIA A100 40 GB", 40960 * MIB, "cuda"),
    "h100-80g": DevicePreset("NVIDIA H100 80 GB", 81559 * MIB, "cuda"),
    "h200": DevicePreset("NVIDIA H200 141 GB", 143771 * MIB, "cuda"),
    "cpu": DevicePreset("CPU", 0, "cpu"),
}

# bytes per linear-layer weight element (scales counted separately, per output channel)
QUANT_WIDTHS = {None: None, "w8a8": 1.0, "int8": 1.0, "fp8": 1.0, "awq": 0.5, "gptq": 0.5}
# extra bytes per weight element for group scales/zeros of 4-bit formats (group size 128)
QUANT_GROUP_OVERHEAD = {"awq": 2.5 / 128, "gptq": 2.5 / 128}
KV_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1,
                  "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
# what an accelerator loses before the KV cache: runtime context, graphs, allocator slack
RUNTIME_OVERHEAD_BYTES = {"cuda": 1 * GIB, "npu": 2 * GIB, "cpu": 0}


def parse_memory(text: str) -> int:
    """``48GiB``, ``48G``, ``64GB``, ``65536MiB`` or plain bytes -> bytes."""
    units = {"gib": GIB, "gb": 10**9, "g": GIB, "mib": MIB, "mb": 10**6, "m": MIB, "tib": 1 << 40,
             "tb": 10**12, "t": 1 << 40, "kib": 1024, "kb": 1000, "k": 1024, "b": 1}
    value = text.strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if value.endswith(unit):
            try:
                return int(float(value[: -len(unit)]) * units[unit])
            except ValueError:
                break
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"--device-memory {text!r} is not a size; write e.g. 48GiB or 64GB") from e
