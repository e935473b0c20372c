"""Kubernetes: a Deployment (probes on /health, device resources, driver mounts) and a Service.

Devices are requested from the vendor device plugins (``huawei.com/Ascend910`` for 910B/910C from
Ascend's plugin, ``nvidia.com/gpu``). The API key, when given, goes into a Secret.
"""

from __future__ import annotations

import yaml

from qwenserve.tools.deploy import render as r
from qwenserve.tools.deploy.options import DeployOptions
from qwenserve.tools.deploy.targets_container import ascend_host_mounts, in_container
from qwenserve.tools.deploy.targets_service import GeneratedFile, require_model


class _NoAliasDumper(yaml.SafeDumper):
    """Write shared dicts (the labels) out in full: no &id001 anchors in a manifest."""

    def ignore_aliases(self, data: object) -> bool:
        return True


_RESOURCE = {"npu": "huawei.com/Ascend910", "cuda": "nvidia.com/gpu"}
_HF_CACHE = "/root/.cache/huggingface"


def _probe(port: int, period_s: int, failures: int) -> dict[str, object]:
    return {
        "httpGet": {"path": "/health", "port": port},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _volumes(opts: DeployOptions) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(volumes, volumeMounts): shared memory, the model or HF cache, and the Ascend driver."""
    volumes: list[dict[str, object]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
    ]
    mounts: list[dict[str, object]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    model = opts.serve.model or ""
    if model.startswith("/"):
        volumes.append({"name": "model", "hostPath": {"path": model, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": model, "readOnly": True})
    else:  # downloads land here; use a PersistentVolumeClaim to keep them across restarts
        volumes.append({"name": "hf-cache", "emptyDir": {}})
        mounts.append({"name": "hf-cache", "mountPath": _HF_CACHE})
    if opts.platform == "npu":
        for i, (host, inner) in enumerate(ascend_host_mounts(opts)):
            volumes.append({"name": f"ascend-{i}", "hostPath": {"path": host.rstrip("/")}})
            mounts.append({"name": f"ascend-{i}", "mountPath": inner.rstrip("/"), "readOnly": True})
    return volumes, mounts


def _container(opts: DeployOptions) -> dict[str, object]:
    inner = in_container(opts)
    port = opts.serve.port
    env: list[dict[str, object]] = [{"name": k, "value": v} for k, v in r.environment(inner, True)]
    if opts.serve.api_key:
        ref = {"name": f"{opts.name}-api-key", "key": "VLLM_API_KEY"}
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    command = r.start_command(inner, executable="qwenserve")
    resources: dict[str, object] = {}
    if opts.platform in _RESOURCE:
        count = str(len(opts.device_ids))
        resources = {
            "limits": {_RESOURCE[opts.platform]: count},
            "requests": {_RESOURCE[opts.platform]: count},
        }
    _, mounts = _volumes(opts)
    return {
        "name": opts.name,
        "image": opts.image,
        "command": command,
        "ports": [{"name": "http", "containerPort": port}],
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        # Loading can take many minutes: the startup probe allows 30 before liveness applies.
        "startupProbe": _probe(port, 10, 180),
        "readinessProbe": _probe(port, 10, 3),
        "livenessProbe": _probe(port, 30, 3),
    }


def manifests(opts: DeployOptions) -> list[dict[str, object]]:
    labels = {"app.kubernetes.io/name": opts.name}
    meta = {"name": opts.name, "namespace": opts.namespace, "labels": labels}
    volumes, _ = _volumes(opts)
    pod = {
        "terminationGracePeriodSeconds": 120,
        "containers": [_container(opts)],
        "volumes": volumes,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": opts.replicas,
            "selector": {"matchLabels": labels},
            # Never run two copies on one set of devices during a rollout.
            "strategy": {"type": "Recreate"}
            if opts.platform != "cpu"
            else {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "selector": labels,
            "ports": [{"name": "http", "port": opts.serve.port, "targetPort": "http"}],
        },
    }
    docs: list[dict[str, object]] = [deployment, service]
    if opts.serve.api_key:
        secret_meta = {**meta, "name": f"{opts.name}-api-key"}
        docs.insert(
            0,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": secret_meta,
                "type": "Opaque",
                "stringData": {"VLLM_API_KEY": opts.serve.api_key},
            },
        )
    return docs


def k8s_files(opts: DeployOptions) -> list[GeneratedFile]:
    require_model(opts, "k8s")
    header = f"# {opts.name} - generated by `qwenserve deploy k8s`. Apply: kubectl apply -f {opts.name}.yaml\n"
    body = yaml.dump_all(manifests(opts), Dumper=_NoAliasDumper, sort_keys=False)
    return [
        GeneratedFile(f"{opts.name}.yaml", header + body, 0o600 if opts.serve.api_key else 0o644)
    ]
