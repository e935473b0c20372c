"""GGUF models: config, weights and tokenizer from one file (parsed with the ``gguf`` package).

Weights are dequantized tensor by tensor while loading, so peak extra memory is one tensor.
llama.cpp stores Llama's q/k projections permuted for its rotary layout; they are permuted back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from qwenserve import envs
from qwenserve.logger import init_logger

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = init_logger(__name__)

# GGUF architecture -> (HF architecture, transformers config class)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


@dataclass(frozen=True)
class GGUFIndex:
    """The scalar metadata and tensor table of a GGUF file (arrays such as the vocabulary are
    left to the tokenizer conversion)."""

    fields: dict[str, Any]
    tensors: list[dict]  # name, type (GGML id), shape (numpy order), offset, nbytes


@functools.lru_cache(maxsize=2)
def gguf_index(path: str) -> GGUFIndex:
    """Parse the file's header once and cache the result on disk: ``gguf.GGUFReader`` parses
    every vocabulary string, which costs seconds at each start-up."""
    cache = os.path.join(envs.cache_dir(), "gguf-index", _file_key(path) + ".json")
    try:
        with open(cache) as f:
            raw = json.load(f)
        return GGUFIndex(raw["fields"], raw["tensors"])
    except (OSError, ValueError, KeyError):
        pass
    index = _read_index(path)
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(cache + ".tmp", "w") as f:
            json.dump({"fields": index.fields, "tensors": index.tensors}, f)
        os.replace(cache + ".tmp", cache)
    except OSError as e:
        logger.warning("could not cache the GGUF index in %s: %s", cache, e)
    return index


def _read_index(path: str) -> GGUFIndex:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e}); re-download it") from e
    fields: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            fields[key + ".length"] = len(f.data)
            continue
        value = f.contents()
        fields[key] = value.item() if hasattr(value, "item") else value
    tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": list(t.data.shape),
                "dtype": str(t.data.dtype), "offset": int(t.data_offset),
                "nbytes": int(t.n_bytes)} for t in reader.tensors]
    return GGUFIndex(fields, tensors)


def _file_key(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _field(index: GGUFIndex, key: str, default: Any = None) -> Any:
    return index.fields.get(key, default)


def read_gguf_config(path: str) -> tuple[Any, tuple[int, ...]]:
    """A transformers config built from the GGUF metadata, and the EOS token ids."""
    import transformers

    reader = gguf_index(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported; supported: "
                         f"{', '.join(_ARCHS)}")
    hf_arch, config_cls = _ARCHS[arch]
    p = f"{arch}."
    num_heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    tensor_names = {t["name"] for t in reader.tensors}
    kwargs = dict(
        vocab_size=_field(reader, p + "vocab_size") or _field(reader, "tokenizer.ggml.tokens.length"),
        hidden_size=hidden,
        intermediate_size=_field(reader, p + "feed_forward_length"),
        num_hidden_layers=_field(reader, p + "block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=_field(reader, p + "attention.head_count_kv", num_heads),
        head_dim=_field(reader, p + "attention.key_length", hidden // num_heads),
        max_position_embeddings=_field(reader, p + "context_length", 4096),
        rms_norm_eps=_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_field(reader, p + "rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        architectures=[hf_arch],
    )
    if arch == "qwen3moe":
        kwargs.update(num_experts=_field(reader, p + "expert_count"),
                      num_experts_per_tok=_field(reader, p + "expert_used_count"),
                      moe_intermediate_size=_field(reader, p + "expert_feed_forward_length"),
                      # llama.cpp renormalizes Qwen3-MoE's top-k unless the file says otherwise
                      norm_topk_prob=bool(_field(reader, p + "expert_weights_norm", True)),
                      # layers without stacked experts have a dense FFN
                      mlp_only_layers=[i for i in range(kwargs["num_hidden_layers"])
                                       if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names])
    config = getattr(transformers, config_cls)(**kwargs)
    eos = kwargs["eos_token_id"]
    return config, (() if eos is None else (int(eos),))


def iter_gguf_weights(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (Hugging Face tensor name, float32 array) for every tensor, one at a time."""
    index = gguf_index(path)
    arch = _field(index, "general.architecture")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in index.tensors:
        if experts := _EXPERTS.fullmatch(t["name"]):
            yield from _expert_weights(experts, _dequantize(data, t))
            continue
        name = _hf_name(t["name"])
        if name is None:
            logger.debug("skipping GGUF tensor %s", t["name"])
            continue
        array = _dequantize(data, t)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (hf_config.num_attention_heads if "q_proj" in name
                     else hf_config.num_key_value_heads)
            array = _unpermute_rotary(array, heads)
        yield name, array


def _dequantize(data: np.ndarray, tensor: dict) -> np.ndarray:
    import gguf

    raw = data[tensor["offset"] : tensor["offset"] + tensor["nbytes"]].view(
        np.dtype(tensor["dtype"]))
    return gguf.quants.dequantize(raw.reshape(tensor["shape"]), gguf.GGMLQuantizationType(
        tensor["type"])).astype(np.float32)


# llama.cpp stacks the experts of a layer: ffn_{gate,up}_exps [E, I, H], ffn_down_exps [E, H, I]
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def _expert_weights(match: re.Match, stacked: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """One HF per-expert tensor per row of a stacked GGUF expert tensor."""
    layer, part = match.groups()
    for expert, array in enumerate(stacked):
        yield f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight", array


def _hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        layer, part, kind = m.groups()
        mapped = _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    mapped = _TOP_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{kind}"


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the rotary halves: (h, D/2, 2) -> (h, 2, D/2)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The HF tokenizer (with chat template) converted from GGUF metadata, cached on disk."""
    from transformers import AutoTokenizer

    cache = os.path.join(envs.cache_dir(), "gguf-tokenizers", _file_key(path))
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # a damaged cache: rebuild it below
            logger.warning("rebuilding the cached tokenizer in %s", cache)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path))
    try:
        tokenizer.save_pretrained(cache)
    except OSError as e:
        logger.warning("could not cache the GGUF tokenizer in %s: %s", cache, e)
    return tokenizer
