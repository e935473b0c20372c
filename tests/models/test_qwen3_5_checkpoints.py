"""Qwen3.5 checkpoint layouts: the published vision-language nesting and the fused MoE experts."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import _config, build_tokenizer, hf_greedy, randomize_
from qwenserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 90))]


def greedy(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_vision_language_checkpoint_serves_its_text_model(tmp_path, caplog):
    import transformers as tf

    text = _config("qwen3_5").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    vlm = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text,
                                                               vision_config=vision)).eval()
    randomize_(vlm, seed=3)
    vlm.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    reference = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"
    with caplog.at_level("INFO", logger="qwenserve"):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=32,
                  language_model_only=True)
    assert any("vision-tower" in r.message for r in caplog.records)
    assert any("recurrent-state checkpoints" in r.message for r in caplog.records)
    assert greedy(llm) == [hf_greedy(reference, p, 10) for p in PROMPTS]


def test_moe_fused_expert_layout(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3_5MoeForCausalLM(_config("qwen3_5_moe")).eval()
    randomize_(model, seed=4)
    model.save_pretrained(tmp_path, save_original_format=False)
    build_tokenizer().save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128)
    assert greedy(llm) == [hf_greedy(model, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("max_num_seqs,expected_slots", [(4, 5), (10_000, None)])
def test_state_slots_are_sized_from_the_budget(tiny_model, max_num_seqs, expected_slots):
    llm = LLM(tiny_model("qwen3_5"), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=8 << 20, max_num_seqs=max_num_seqs)
    plan = llm.llm_engine.plan
    per_seq = plan.state_bytes_per_seq
    if expected_slots is None:  # capped at half the budget
        assert plan.num_state_slots == (8 << 20) // 2 // per_seq
    else:
        assert plan.num_state_slots == expected_slots
    # more requests than slots: the extra ones wait, and everything completes
    outs = llm.generate([{"prompt_token_ids": [i + 3] * 5} for i in range(12)],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
