"""GGUF loading: a tiny Llama written as llama.cpp writes it (q/k permuted) matches HF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.tiny_models import hf_greedy, load_hf_model
from qwenserve import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permutation of q/k rows for llama.cpp's rotary layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in NAMES:
        return NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def write_gguf(hf_model, path: str) -> None:
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if "q_proj" in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif "k_proj" in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_llama_gguf_matches_hf(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("QWENSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = tiny_model("llama")
    hf = load_hf_model(hf_dir)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path)
    llm = LLM(path, tokenizer=hf_dir, dtype="float32", max_model_len=128)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
    assert torch.get_default_dtype() == torch.float32
