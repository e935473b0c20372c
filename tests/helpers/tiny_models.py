"""Tiny random-weight models written with transformers, for parity and server tests.

Weights are re-drawn with a larger spread than HF's init (and norms away from 1) so that logits
are peaked (greedy choices are not near-ties) and norm-convention bugs cannot hide.
"""

from __future__ import annotations

import os
from typing import Any

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Hello world! How are you today? I am fine, thank you.",
    "qwenserve serves Qwen models with paged attention and continuous batching.",
    "你好，世界。今天天气很好。 😀 🚀 café naïve",
    "def add(a, b):\n    return a + b\n",
    "0123456789 numbers, punctuation; quotes \"like this\" and 'that'.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-6)


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _config(arch: str, **overrides: Any) -> Any:
    import transformers as tf

    kw = dict(BASE)
    if arch == "llama":
        kw.update(rope_theta=500000.0, tie_word_embeddings=False)
        cls = tf.LlamaConfig
    elif arch == "qwen2":
        kw.update(rope_theta=1e6, tie_word_embeddings=True)
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        kw.update(rope_theta=1e6, head_dim=32, tie_word_embeddings=False)
        cls = tf.Qwen3Config
    elif arch == "qwen3_moe":
        kw.update(rope_theta=1e6, head_dim=16, tie_word_embeddings=False, moe_intermediate_size=32,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3,
                  mlp_only_layers=[1])
        cls = tf.Qwen3MoeConfig
    elif arch in ("qwen3_5", "qwen3_5_moe"):
        kw = _qwen3_5_text(arch)
        cls = tf.Qwen3_5TextConfig if arch == "qwen3_5" else tf.Qwen3_5MoeTextConfig
    elif arch == "qwen3_next":  # Qwen3.5's shapes; layer 1 dense, the rest MoE
        kw = _qwen3_5_text("qwen3_5_moe")
        kw.update(intermediate_size=128, mlp_only_layers=[1], decoder_sparse_step=1,
                  norm_topk_prob=True)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7,
                                 "partial_rotary_factor": 0.25}
        cls = tf.Qwen3NextConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def _qwen3_5_text(arch: str) -> dict:
    """Layers L L L F (+ a second group): two full-attention and six DeltaNet layers."""
    kw = dict(vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
              tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                               "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                               "mrope_interleaved": True})
    if arch == "qwen3_5":
        kw["intermediate_size"] = 128
    else:
        kw.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2)
    return kw


def randomize_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates: log U(0.01, 16), as HF draws them
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def make_tiny_model(arch: str, path: str, seed: int = 0, **overrides: Any) -> str:
    """Write a random-weight model + tokenizer to ``path`` (skipped if already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import transformers as tf

    config = _config(arch, **overrides)
    tokenizer = build_tokenizer()
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """HF's model (float64: its MoE experts as a plain loop, since grouped_mm has no float64)."""
    import transformers as tf

    kw = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens by full recomputation each step (no cache: the plainest reference)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def hf_mtp_layer(path: str) -> Any:
    """A transformers decoder layer shaped like the checkpoint's MTP layer: full attention, with
    the MLP layer 0 would have (MoE in MoE checkpoints). Also the tests' reference layer."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"  # causal without an explicit mask
    model = tf.AutoModelForCausalLM.from_config(config)
    types = config.layer_types
    moe0 = type(model.model.layers[0].mlp)
    idx = next(i for i, t in enumerate(types)
               if t == "full_attention" and type(model.model.layers[i].mlp) is moe0)
    return model.model.layers[idx]


def add_mtp_head(path: str, seed: int = 1) -> str:
    """Add random ``mtp.*`` tensors (fc, pre-fc norms, one layer, norm) to a tiny Qwen3.5 /
    Qwen3-Next checkpoint, and ``mtp_num_hidden_layers: 1`` to its config (skipped if there)."""
    import json

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if any(n.startswith("mtp.") for n in tensors):
        return path
    layer = hf_mtp_layer(path)
    hidden = layer.input_layernorm.weight.shape[0]
    head = torch.nn.Module()
    head.layer = layer
    head.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        setattr(head, norm, torch.nn.Module())
        getattr(head, norm).weight = torch.nn.Parameter(torch.zeros(hidden))
    randomize_(head, seed)
    for name, tensor in head.state_dict().items():
        name = name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
        tensors["mtp." + name] = tensor.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def make_eagle3_head(target: str, path: str, seed: int = 2, draft_vocab_size: int = 256,
                     aux_layer_ids: list[int] | None = None, **overrides: Any) -> str:
    """A random EAGLE-3 head (``LlamaForCausalLMEagle3``, vLLM's tensor names) for the tiny
    ``target``: fc [H, 3H], ``midlayer.*`` (q/k/v read 2H), norm, lm_head over a draft
    vocabulary of ``draft_vocab_size`` random target ids (``d2t`` offsets, ``t2d`` mask); no
    embedding (the target's is shared). ``overrides`` change the head's config.json."""
    import json

    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    with open(os.path.join(target, "config.json")) as f:
        tc = json.load(f)
    hidden, vocab = tc["hidden_size"], tc["vocab_size"]
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  hidden_size=hidden, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=1, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=1024, vocab_size=vocab,
                  draft_vocab_size=draft_vocab_size, target_hidden_size=hidden,
                  tie_word_embeddings=False, torch_dtype="float32")
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    config.update(overrides)
    h, nh, nkv, hd, inter = (config["hidden_size"], config["num_attention_heads"],
                             config["num_key_value_heads"], config["head_dim"],
                             config["intermediate_size"])
    shapes = {"fc.weight": (h, 3 * config["target_hidden_size"]),
              "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
              "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
              "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, nh * hd),
              "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h),
              "midlayer.mlp.down_proj.weight": (h, inter),
              "lm_head.weight": (draft_vocab_size, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: 0.15 * torch.randn(s, generator=gen) for n, s in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):
        tensors[norm + ".weight"] = 1.0 + 0.2 * torch.randn(h, generator=gen)
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    tensors["d2t"] = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    os.makedirs(path, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
