"""Device presets and quantization widths.

A preset's memory is the total that torch reports (``torch.npu/cuda.mem_get_info()``), not the
marketing size: the engine and vLLM multiply that figure by ``--gpu-memory-utilization``. A 64 GB
910B shows 60.96 GiB to torch (the driver keeps ~3 GiB), which is 5 % of the plan.
"""

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


def _gib(value: float) -> int:
    return int(value * GIB)


# Totals from torch's out-of-memory reports ("... GiB total capacity") on each device; the 32 GB
# 910B is assumed to lose the same ~3 GiB to the driver as the 64 GB one (not observed).
DEVICES = {
    "910b-64g": DevicePreset("Ascend 910B 64 GB", _gib(60.96), "npu"),
    "910b-32g": DevicePreset("Ascend 910B 32 GB", 32 * GIB - _gib(3.04), "npu"),
    "a100-80g": DevicePreset("NVIDIA A100 80 GB", _gib(79.14), "cuda"),
    "a100-40g": DevicePreset("NVIDIA A100 40 GB", _gib(39.50), "cuda"),
    "h100-80g": DevicePreset("NVIDIA H100 80 GB", _gib(79.18), "cuda"),
    "h200": DevicePreset("NVIDIA H200 141 GB", _gib(139.80), "cuda"),
    "cpu": DevicePreset("CPU", 0, "cpu"),
}

# Bytes per weight element of linear and expert matrices (per-channel scales counted apart).
# w4a16: compressed-tensors 4-bit weights (as AWQ/GPTQ).
QUANT_WIDTHS = {None: None, "w8a8": 1.0, "int8": 1.0, "fp8": 1.0, "awq": 0.5, "gptq": 0.5,
                "w4a16": 0.5}
# extra bytes per weight element for group scales/zeros of 4-bit formats (group size 128)
QUANT_GROUP_OVERHEAD = {"awq": 2.5 / 128, "gptq": 2.5 / 128, "w4a16": 2.5 / 128}
# the Gated DeltaNet state's dtype (config.resolve_ssm_cache_dtype's value)
SSM_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1,
                  "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
# what an accelerator loses before the KV cache: runtime context, collectives, allocator slack
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
