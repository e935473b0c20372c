"""config.json files with the published shapes of Qwen models, for the `plan` tests.

Shapes are those of the models' config.json on the Hugging Face Hub; ``PUBLISHED_PARAMS`` are the
parameter counts the Hub shows for the dense and Qwen3 MoE checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

_QWEN25 = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    use_sliding_window=False,
    sliding_window=131072,
)
_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_act="silu",
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    head_dim=128,
    attention_bias=False,
)


def _hybrid_layers(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


_QWEN35_TEXT = dict(
    model_type="qwen3_5_text",
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    layer_types=_hybrid_layers(64),
    vocab_size=248320,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attn_output_gate=True,
    dtype="bfloat16",
    hidden_act="silu",
    attention_bias=False,
    mamba_ssm_dtype="float32",
    mtp_num_hidden_layers=1,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
)
_QWEN35_MOE_TEXT = {
    **{k: v for k, v in _QWEN35_TEXT.items() if k != "intermediate_size"},
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "linear_num_value_heads": 32,
    "layer_types": _hybrid_layers(40),
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
)

CONFIGS: dict[str, dict] = {
    "Qwen2.5-7B": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4},
    "Qwen2.5-32B": {**_QWEN25, "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8},
    "Qwen2.5-72B": {**_QWEN25, "hidden_size": 8192, "intermediate_size": 29568,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "Qwen2.5-0.5B": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    "Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8},
    "Qwen3-32B": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600,
                  "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8},
    "Qwen3-30B-A3B": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"],
                      "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True},
    "Qwen3.5-27B": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                    "tie_word_embeddings": False, "text_config": _QWEN35_TEXT,
                    "vision_config": {**_VISION, "out_hidden_size": 5120}},
    "Qwen3.5-35B-A3B": {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                        "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                        "text_config": _QWEN35_MOE_TEXT,
                        "vision_config": {**_VISION, "out_hidden_size": 2048}},
}  # fmt: skip

PUBLISHED_PARAMS = {
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-72B": 72_706_203_648,
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen3-0.6B": 596_049_920,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-30B-A3B": 30_532_122_624,
}


def write_model(root: Path, name: str, **overrides: object) -> str:
    """A folder holding only config.json (plan reads nothing else); returns its path."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**CONFIGS[name], **overrides}))
    return str(folder)


def text_config(name: str) -> dict:
    return CONFIGS[name].get("text_config", CONFIGS[name])
