"""The only reader of ``os.environ``.

Every setting has a ``QWENSERVE_*`` name and, where vLLM users already set one, the ``VLLM_*`` name
as a fallback, so existing deployment scripts keep working. Values are read at call time (not at
import) so tests and launchers can change them.
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}


def _get(name: str, vllm_name: str | None = None, default: str | None = None) -> str | None:
    value = os.environ.get(f"QWENSERVE_{name}")
    if value is None and vllm_name is not None:
        value = os.environ.get(vllm_name)
    return default if value is None or value == "" else value


def _flag(name: str, vllm_name: str | None = None) -> bool:
    value = _get(name, vllm_name)
    return value is not None and value.strip().lower() in _TRUE


def logging_level() -> str:
    return (_get("LOGGING_LEVEL", "VLLM_LOGGING_LEVEL", "INFO") or "INFO").upper()


def cpu_kvcache_space_gib() -> float | None:
    """KV cache size on CPU in GiB (``QWENSERVE_CPU_KVCACHE_SPACE`` / ``VLLM_CPU_KVCACHE_SPACE``)."""
    value = _get("CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")
    if value is None:
        return None
    try:
        gib = float(value)
    except ValueError as e:
        raise ValueError(
            f"QWENSERVE_CPU_KVCACHE_SPACE={value!r} is not a number of GiB; set it to e.g. 4"
        ) from e
    if gib < 0:
        raise ValueError(f"QWENSERVE_CPU_KVCACHE_SPACE={value!r} must be >= 0 GiB")
    return gib or None  # vLLM treats 0 as "unset"


def use_modelscope() -> bool:
    return _flag("USE_MODELSCOPE", "VLLM_USE_MODELSCOPE")


def api_key() -> str | None:
    return _get("API_KEY", "VLLM_API_KEY")


def http_timeout_keep_alive_s() -> float:
    """Idle keep-alive connections close after this (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s)."""
    return _number("HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5.0)


def http_header_timeout_s() -> float:
    """A connection that has not sent complete request headers after this closes (10 s)."""
    return _number("HTTP_HEADER_TIMEOUT", None, 10.0)


def http_body_timeout_s() -> float:
    """A request whose body has not fully arrived this long after its headers gets a 408 and
    its connection closes (60 s: a 32 MB body at ~0.5 MB/s)."""
    return _number("HTTP_BODY_TIMEOUT", None, 60.0)


def server_dev_mode() -> bool:
    """Serve the development routes (``/reset_prefix_cache``), as ``VLLM_SERVER_DEV_MODE``."""
    return _flag("SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")


def platform_override() -> str | None:
    return _get("PLATFORM")


def allow_long_max_model_len() -> bool:
    return _flag("ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def hf_hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> str:
    """Where qwenserve keeps derived files (e.g. tokenizers converted from GGUF)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "qwenserve")
    return _get("CACHE_DIR", None, default) or default


def worker_multiproc_method() -> str:
    return _get("WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD", "spawn") or "spawn"


def get(name: str, default: str | None = None) -> str | None:
    """Read any other environment variable (e.g. ``MASTER_ADDR``) through this one module."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def int8_float_vocab() -> bool:
    """``--quantization int8`` keeps the embedding and LM head in float
    (``QWENSERVE_INT8_FLOAT_VOCAB=1``): more memory, no int8 rounding in the logits."""
    return _flag("INT8_FLOAT_VOCAB")


def _number(name: str, vllm_name: str | None, default: float) -> float:
    value = _get(name, vllm_name)
    if value is None:
        return default
    source = f"QWENSERVE_{name}" if os.environ.get(f"QWENSERVE_{name}") else str(vllm_name)
    try:
        number = float(value)
    except ValueError as e:
        raise ValueError(f"{source}={value!r} is not a number") from e
    if number <= 0:
        raise ValueError(f"{source}={value!r} must be > 0")
    return number


def image_fetch_timeout_s() -> float:
    """Timeout of one http(s) image download (``VLLM_IMAGE_FETCH_TIMEOUT``, vLLM's 5 s)."""
    return _number("IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT", 5.0)


def max_media_download_bytes() -> int:
    """Largest image download or data URL (``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB``, 256 MiB)."""
    mib = _number("MAX_MEDIA_DOWNLOAD_SIZE_MB", "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", 256)
    return int(mib * (1 << 20))


def max_image_pixels() -> int:
    """Largest decoded image, width x height (``VLLM_MAX_IMAGE_PIXELS``, vLLM's default)."""
    return int(_number("MAX_IMAGE_PIXELS", "VLLM_MAX_IMAGE_PIXELS", 178_956_970))


def enable_multiprocessing() -> bool:
    """The server's engine runs in its own process (default); ``QWENSERVE_ENABLE_MULTIPROCESSING=0``
    (or vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) runs it on a thread of the API process, for
    debugging."""
    value = _get("ENABLE_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING", "1") or "1"
    return value.strip().lower() not in {"0", "false", "no", "off"}


def keep_alive_on_engine_death() -> bool:
    """Keep the API server up (``/health`` 503) when the engine dies, instead of exiting 1."""
    return _flag("KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH")


def cpu_omp_threads_bind() -> str:
    """Which CPU cores the engine process's OpenMP threads use (``QWENSERVE_CPU_OMP_THREADS_BIND``
    / ``VLLM_CPU_OMP_THREADS_BIND``): ``auto`` (default), ``all``, or a list such as ``0-3,6``."""
    return (_get("CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND", "auto") or "auto").strip()


def engine_ready_timeout_s() -> float:
    """How long the server waits for its engine process to load the model (default 1 hour)."""
    return _number("ENGINE_READY_TIMEOUT_S", "VLLM_ENGINE_READY_TIMEOUT_S", 3600.0)


def native_kernels_enabled() -> bool:
    """Compiled C++ kernels (``qwenserve.native``) where a compiler is present; ``QWENSERVE_NATIVE=0``
    runs the pure-PyTorch kernels instead (the fallback a machine without a compiler gets)."""
    value = _get("NATIVE", None, "1") or "1"
    return value.strip().lower() not in {"0", "false", "no", "off"}


def kv_pull_timeout_s() -> float:
    """P/D consumer: how long a KV pull waits for the producer's answer (30 s)."""
    return _number("KV_PULL_TIMEOUT_S", None, 30.0)


def kv_hold_timeout_s() -> float:
    """P/D producer: how long held KV blocks wait for a consumer before they are freed
    (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s)."""
    return _number("KV_HOLD_TIMEOUT_S", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480.0)


def host_ip() -> str | None:
    """This host's address as other machines reach it (``VLLM_HOST_IP``), when set."""
    return _get("HOST_IP", "VLLM_HOST_IP")


def prometheus_multiproc_dir() -> str | None:
    """prometheus_client's multiprocess mode (set by ``--api-server-count N`` for its API
    processes, or by the user, as with vLLM): metric values live in files in this folder."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
