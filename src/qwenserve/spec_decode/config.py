"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's SpeculativeConfig keys.

No torch: the engine and the CLI parse it before anything loads. Every key vLLM has is either
honoured here or refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qwenserve.config import SpeculativeConfig
from qwenserve.json_option import json_object_option

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
MTP = "mtp"
EAGLE3 = "eagle3"  # an EAGLE-3 head (``"model"``: its folder) reading the target's hidden states
# vLLM's names for the checkpoint's own multi-token-prediction head; all run as ``mtp``.
MTP_METHODS = (MTP, "qwen3_5_mtp", "qwen3_next_mtp")
REFUSED_METHODS = {
    "eagle": "EAGLE heads are not implemented in qwenserve",
    "medusa": "Medusa heads are not implemented in qwenserve",
    "mlp_speculator": "MLP speculators are not implemented in qwenserve",
    "suffix": "suffix decoding is not implemented in qwenserve",
}
# vLLM keys that are accepted only at their neutral value (anything else is refused by name).
_NEUTRAL = {
    "quantization": (None,),
    "max_model_len": (None,),
    "revision": (None,),
    "code_revision": (None,),
    "disable_padded_drafter_batch": (None, False, True),
    "enforce_eager": (None, False, True),
    "disable_log_stats": (None, False),
}
_KNOWN = {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
          "prompt_lookup_max", "disable_by_batch_size", "draft_tensor_parallel_size", *_NEUTRAL}


def parse_speculative_config(value: str | dict[str, Any] | None,
                             mtp_layers: int = 1) -> SpeculativeConfig | None:
    """JSON text or a dict -> config (None: no speculation); ``ValueError`` names the fix.
    ``mtp_layers``: the checkpoint's ``mtp_num_hidden_layers``, MTP's default
    ``num_speculative_tokens`` (as vLLM's ``n_predict``)."""
    if value is None or value == "":
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    value = json_object_option("--speculative-config", value)
    unknown = sorted(set(value) - _KNOWN)
    if unknown:
        raise ValueError(f"--speculative-config: unknown or unsupported key(s) {unknown}; "
                         f"supported: {', '.join(sorted(_KNOWN))}")
    for key, allowed in _NEUTRAL.items():
        if value.get(key) not in allowed:
            raise ValueError(f"--speculative-config {key}={value[key]!r} is not implemented "
                             "in qwenserve; remove it")
    method = value.get("method") or (DRAFT_MODEL if value.get("model") else None)
    if method is None:
        raise ValueError('--speculative-config needs "method": "ngram", "draft_model" '
                         '(with "model"), "eagle3" (with "model") or "mtp"')
    if method in REFUSED_METHODS:
        raise ValueError(f"--speculative-config method {method!r}: {REFUSED_METHODS[method]}; "
                         "use ngram, draft_model, eagle3 or mtp")
    if method in MTP_METHODS:
        if value.get("model"):
            raise ValueError(f'--speculative-config method {method!r} uses the target '
                             'checkpoint\'s own mtp.* head; remove "model"')
        method = MTP
    if method not in (NGRAM, DRAFT_MODEL, MTP, EAGLE3):
        raise ValueError(f"--speculative-config method {method!r} is unknown; use ngram, "
                         "draft_model, eagle3 or mtp")
    k = _int(value, "num_speculative_tokens", mtp_layers if method == MTP else None)
    if k is None or k < 1:
        raise ValueError("--speculative-config needs num_speculative_tokens >= 1")
    config = SpeculativeConfig(method=method, num_speculative_tokens=k,
                               model=value.get("model"),
                               disable_by_batch_size=_int(value, "disable_by_batch_size", None),
                               draft_tensor_parallel_size=_int(
                                   value, "draft_tensor_parallel_size", None))
    if method == NGRAM:
        lo = _int(value, "prompt_lookup_min", None)
        hi = _int(value, "prompt_lookup_max", None)
        lo, hi = (lo or hi or 1), (hi or lo or 1)  # vLLM: one of them gives the other
        if not 1 <= lo <= hi:
            raise ValueError("--speculative-config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {lo} and {hi}")
        config = SpeculativeConfig(NGRAM, k, lo, hi, None, config.disable_by_batch_size,
                                   config.draft_tensor_parallel_size)
    elif method in (MTP, EAGLE3):
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if value.get(key) is not None:
                raise ValueError(f"--speculative-config {key} applies to method ngram only; "
                                 "remove it")
        if method == EAGLE3 and not config.model:
            raise ValueError('--speculative-config method eagle3 needs "model": the EAGLE-3 '
                             "head's folder or hub id (trained for this target)")
    elif not config.model:
        raise ValueError('--speculative-config method draft_model needs "model": the '
                         "drafter's folder (same vocabulary as the target)")
    if config.draft_tensor_parallel_size is not None and config.draft_tensor_parallel_size < 1:
        raise ValueError("--speculative-config draft_tensor_parallel_size must be >= 1 (1, or "
                         "the target's --tensor-parallel-size)")
    if config.disable_by_batch_size is not None and config.disable_by_batch_size < 2:
        raise ValueError("--speculative-config disable_by_batch_size must be >= 2")
    return config


def _int(value: dict[str, Any], key: str, default: int | None) -> int | None:
    got = value.get(key, default)
    if got is None:
        return None
    if isinstance(got, str) and got.strip().isdigit():  # dotted flags give strings
        return int(got)
    if isinstance(got, bool) or not isinstance(got, int):
        raise ValueError(f"--speculative-config {key} must be an integer, got {got!r}")
    return got


def mtp_num_layers(hf_config: PretrainedConfig) -> int:
    """How many MTP layers a checkpoint's config declares (``mtp_num_hidden_layers``, or
    ``num_nextn_predict_layers``); 1 when it says nothing, as vLLM assumes."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        got = getattr(hf_config, key, None)
        if isinstance(got, int) and got > 0:
            return got
    return 1


def mtp_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV slots to allocate past each step's tokens: MTP / EAGLE-3 draft steps 2..k write the
    head's KV at the k - 1 positions after the last one the target computes."""
    if config is None or config.method not in (MTP, EAGLE3):
        return 0
    return config.num_speculative_tokens - 1
