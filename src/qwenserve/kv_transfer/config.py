"""``--kv-transfer-config``: vLLM's KVTransferConfig, checked by its field names (no torch).

Every connector name the vLLM and vLLM Ascend guides use for prefill/decode disaggregation maps
onto qwenserve's one transport: paged KV blocks as raw bytes over ZeroMQ/TCP on ``kv_port``
(+ the tensor-parallel rank). The Mooncake / NIXL / RDMA transfer engines are not used, so their
own options (``use_ascend_direct``, ``ascend_local_comm_res_path``, ``kv_buffer_device``, ...) are
accepted and said, once at start-up, to have no effect here.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qwenserve import envs
from qwenserve.json_option import json_object_option

FLAG = "--kv-transfer-config"
# P/D connectors of vLLM and vLLM Ascend: the same pull protocol, carried here over TCP.
CONNECTORS = ("MooncakeConnectorV1", "MooncakeConnector", "MooncakeLayerwiseConnector",
              "NixlConnector", "P2pNcclConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port
# vLLM KVTransferConfig fields that describe a transfer engine qwenserve does not use.
TRANSPORT_ONLY_KEYS = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
                       "kv_connector_module_path", "enable_permute_local_kv")
KNOWN_KEYS = ("kv_connector", "kv_role", "kv_port", "kv_ip", "engine_id",
              "kv_connector_extra_config", "kv_load_failure_policy", *TRANSPORT_ONLY_KEYS)
FAILURE_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class SideLayout:
    """``kv_connector_extra_config.prefill`` / ``.decode``: one side's DP and TP sizes."""

    dp_size: int = 1
    tp_size: int = 1


@dataclass(frozen=True)
class KVTransferConfig:
    connector: str
    role: str  # kv_producer | kv_consumer | kv_both
    engine_id: str
    kv_ip: str | None = None  # the producer binds this address (None: every interface)
    host: str = "127.0.0.1"  # the address the producer tells consumers (kv_ip, or detected)
    kv_port: int = DEFAULT_KV_PORT  # + the tensor-parallel rank
    prefill: SideLayout | None = None
    decode: SideLayout | None = None
    failure_policy: str = "fail"  # a failed pull: fail the request, or prefill it locally
    no_effect_keys: tuple[str, ...] = field(default=())  # transfer-engine options, accepted

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def startup_notes(self) -> list[str]:
        notes = [f"{FLAG}: {self.connector} as {self.role}, engine_id {self.engine_id}; KV "
                 f"blocks travel as raw bytes over ZeroMQ/TCP"
                 + (f", served on {self.kv_ip or '*'}:{self.kv_port} (consumers are told "
                    f"{self.host})" if self.is_producer else "")
                 + " (the Mooncake/NIXL/RDMA transfer engine is not used)"]
        if self.no_effect_keys:
            notes.append(f"{FLAG}: {', '.join(self.no_effect_keys)}: no effect (options of "
                         "the transfer engine qwenserve does not use)")
        return notes


def parse_kv_transfer_config(value: str | Mapping[str, Any] | None) -> KVTransferConfig | None:
    """The flag's JSON as a config; ``ValueError`` naming the key and the fix."""
    if value is None:
        return None
    raw = json_object_option(FLAG, value)
    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"{FLAG}: unknown key(s) {unknown}; known: {list(KNOWN_KEYS)}")
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"{FLAG}: kv_connector {connector!r} is not supported; qwenserve "
                         f"serves prefill/decode disaggregation with one of {list(CONNECTORS)} "
                         "(all carried over TCP)")
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"{FLAG}: kv_role must be one of {list(ROLES)}, got {role!r}")
    policy = raw.get("kv_load_failure_policy", "fail")
    if policy not in FAILURE_POLICIES:
        raise ValueError(f"{FLAG}: kv_load_failure_policy must be one of "
                         f"{list(FAILURE_POLICIES)}, got {policy!r}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"{FLAG}: kv_connector_extra_config must be an object, got {extra!r}")
    no_effect = [k for k in TRANSPORT_ONLY_KEYS if k in raw]
    no_effect += [f"kv_connector_extra_config.{k}" for k in extra
                  if k not in ("prefill", "decode")]
    return KVTransferConfig(
        connector=connector, role=role,
        engine_id=str(raw["engine_id"]) if raw.get("engine_id") is not None
        else str(uuid.uuid4()),
        kv_ip=str(raw["kv_ip"]) if raw.get("kv_ip") else None,
        host=str(raw["kv_ip"]) if raw.get("kv_ip") else advertised_host(),
        kv_port=_port(raw.get("kv_port", DEFAULT_KV_PORT)),
        prefill=_side(extra, "prefill"), decode=_side(extra, "decode"),
        failure_policy=policy, no_effect_keys=tuple(no_effect))


def advertised_host() -> str:
    """The address consumers on other machines reach this one at, as vLLM's ``get_ip``:
    ``QWENSERVE_HOST_IP`` / ``VLLM_HOST_IP``, else the interface of the default route (a UDP
    socket's choice: no packet is sent), else loopback."""
    ip = envs.host_ip()
    if ip:
        return ip
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _port(value: object) -> int:
    """A TCP port; the guides write it as a string ("30000")."""
    try:
        port = int(str(value))
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{FLAG}: kv_port must be a TCP port (1-65535), got {value!r}")
    return port


def _side(extra: Mapping[str, Any], name: str) -> SideLayout | None:
    side = extra.get(name)
    if side is None:
        return None
    key = f"kv_connector_extra_config.{name}"
    if not isinstance(side, Mapping):
        raise ValueError(f"{FLAG}: {key} must be an object like {{\"dp_size\": 1, "
                         f"\"tp_size\": 1}}, got {side!r}")
    unknown = sorted(set(side) - {"dp_size", "tp_size"})
    if unknown:
        raise ValueError(f"{FLAG}: {key}: unknown key(s) {unknown}; known: dp_size, tp_size")
    sizes = {}
    for k in ("dp_size", "tp_size"):
        v = side.get(k, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{FLAG}: {key}.{k} must be an integer >= 1, got {v!r}")
        sizes[k] = v
    return SideLayout(**sizes)
