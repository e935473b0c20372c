"""GGUF loading: tiny random models written as llama.cpp's convert_hf_to_gguf.py writes them
(Llama's q/k permuted, Qwen2's biases and tied head, Qwen3's q/k norms, Qwen3-MoE's stacked
experts, beside a dense layer) give Hugging Face's greedy tokens."""

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
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permutation of q/k rows for llama.cpp's rotary layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_tensors(hf_model, arch: str):
    """(GGUF name, array) as convert_hf_to_gguf.py writes them."""
    cfg = hf_model.config
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied head is not written
        if name in NAMES:
            yield NAMES[name], array
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> stacked gate and up [E, I, H]
            gate, up = np.split(array, 2, axis=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate
            yield f"blk.{layer}.ffn_up_exps.weight", up
            continue
        if rest == "mlp.experts.down_proj":  # [E, H, I]
            yield f"blk.{layer}.ffn_down_exps.weight", array
            continue
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        yield f"blk.{layer}.{NAMES[module]}.{kind}", array


def write_gguf(hf_model, arch: str, path: str) -> None:
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, GGUF_ARCH[arch])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name, array in gguf_tensors(hf_model, arch):
        w.add_tensor(name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_tiny_gguf_matches_hf(tiny_model, tmp_path, monkeypatch, arch):
    monkeypatch.setenv("QWENSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = tiny_model(arch)
    hf = load_hf_model(hf_dir)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_gguf(hf, arch, path)
    llm = LLM(path, tokenizer=hf_dir, dtype="float32", max_model_len=128,
              max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
    assert torch.get_default_dtype() == torch.float32
