"""Flags of the P/D test servers and engines (a module of its own: ``conftest`` names clash
when several test folders are collected together)."""

from __future__ import annotations

import json


def kv_config(role: str, kv_port: int, engine_id: str, tp: int = 1) -> dict:
    return {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": str(kv_port),
            "engine_id": engine_id, "kv_ip": "127.0.0.1",
            "kv_connector_extra_config": {"use_ascend_direct": True,
                                          "prefill": {"dp_size": 1, "tp_size": tp},
                                          "decode": {"dp_size": 1, "tp_size": tp}}}


def serve_args(model: str, role: str, kv_port: int, engine_id: str, tp: int = 1) -> list[str]:
    return [model, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
            "16M", "--disable-uvicorn-access-log", "-tp", str(tp), "--kv-transfer-config",
            json.dumps(kv_config(role, kv_port, engine_id, tp))]
