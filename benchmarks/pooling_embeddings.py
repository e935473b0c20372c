"""Embeddings per second: qwenserve's pooling runner (``LLM(runner="pooling").encode``) against
Hugging Face ``AutoModel`` on the same batch of token ids, on a random-weight Qwen3 decoder
saved as Qwen3-Embedding is (bare ``Qwen3Model`` weights). Both in fp32 on CPU; the batch is the
same prompts, HF pads to the longest and reads each prompt's last real token.

    PYTHONPATH=src python benchmarks/pooling_embeddings.py [--prompts 32] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

SHAPE = dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6,
             tie_word_embeddings=True)


def build(path: str) -> None:
    import transformers as tf

    if os.path.isfile(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(tf.Qwen3Config(**SHAPE), dtype=torch.float32)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["architectures"] = ["Qwen3ForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)


def hf_embed(path: str, prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
    import transformers as tf

    model = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    with torch.no_grad():
        model(ids[:2, :16], attention_mask=mask[:2, :16])  # warm-up
        start = time.perf_counter()
        hidden = model(ids, attention_mask=mask).last_hidden_state
        elapsed = time.perf_counter() - start
    last = mask.sum(1) - 1
    return elapsed, hidden[torch.arange(len(prompts)), last]


def qwenserve_embed(path: str, prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
    from qwenserve import LLM

    llm = LLM(path, dtype="float32", runner="pooling", max_model_len=2048,
              max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30,
              enable_prefix_caching=False)
    llm.encode([{"prompt_token_ids": prompts[0][:16]}])  # warm-up
    start = time.perf_counter()
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts])
    elapsed = time.perf_counter() - start
    llm.llm_engine.shutdown()
    return elapsed, torch.tensor([o.pooled for o in outs])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--path", default="/tmp/qwenserve-bench/qwen3-embedding-shape")
    args = parser.parse_args()
    build(args.path)
    rng = random.Random(0)
    # lengths vary (tokens/2 .. tokens) as real documents do; HF pads them to the longest
    prompts = [[rng.randrange(1, SHAPE["vocab_size"]) for _ in range(
        rng.randint(args.tokens // 2, args.tokens))] for _ in range(args.prompts)]
    hf_s, hf_vecs = hf_embed(args.path, prompts)
    qs_s, qs_vecs = qwenserve_embed(args.path, prompts)
    print(json.dumps({
        "prompts": args.prompts, "tokens": sum(map(len, prompts)),
        "hf_embeddings_per_s": round(args.prompts / hf_s, 1),
        "qwenserve_embeddings_per_s": round(args.prompts / qs_s, 1),
        "ratio": round(hf_s / qs_s, 2),
        "max_abs_diff": float((hf_vecs - qs_vecs).abs().max()),
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
