"""Images end to end: qwenserve's engine vs HF ``generate`` on a Qwen3.5-shaped
vision-language model with the real vision-tower shape (random weights, CPU).

Model: Qwen3.5-0.8B's text shape (``common.QWEN35_08B``) and HF's ``Qwen3_5VisionConfig``
tower (hidden 1152, MLP 4304, 16 heads, patch 16, merge 2; out 1024); ``--text-layers`` and
``--vision-depth`` shorten them on a small machine (time scales about per layer). Images are
448 x 448 (28 x 28 patches -> 196 tokens), each request a different random picture plus a
short question, rendered with a ChatML template.

  * TTFT: one request, ``max_tokens=1``: qwenserve ``LLM.generate`` (processing included) vs
    HF: the same image processor + placeholder expansion, then ``generate(max_new_tokens=1)``.
  * Throughput: ``--requests`` image requests of ``--max-tokens`` greedy tokens each, all at
    once in qwenserve vs HF one request at a time.

The variants alternate; median (and min) of ``--repeats``. Greedy tokens are compared. The
throughput row also gives each side's process CPU time (all threads): on a shared machine it
moves far less with other people's load than wall time does.

    python benchmarks/vision_e2e.py [--text-layers 24] [--vision-depth 27] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CACHE_DIR, QWEN35_08B  # noqa: E402

VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
              out_hidden_size=1024, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=2304, in_channels=3, hidden_act="gelu_pytorch_tanh")
SIDE = 448
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_checkpoint(text_layers: int, vision_depth: int) -> str:
    """A random ``Qwen3_5ForConditionalGeneration`` folder (saved once under CACHE_DIR)."""
    path = os.path.join(CACHE_DIR, f"qwen3.5-0.8b-vl-t{text_layers}-v{vision_depth}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import transformers as tf
    from common import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tokenizer.chat_template = TEMPLATE
    start, end, pad, video = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    text = dict(QWEN35_08B, num_hidden_layers=text_layers, eos_token_id=tokenizer.eos_token_id)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[11, 11, 10],
                                   mrope_interleaved=True)
    cfg = tf.Qwen3_5Config(text_config=text, vision_config=dict(VISION, depth=vision_depth),
                           image_token_id=pad, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end,
                           tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForConditionalGeneration(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
                   "temporal_patch_size": 2, "merge_size": 2,
                   "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                   "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, f)
    return path


def images(n: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8), "RGB")
            for _ in range(n)]


class HFRunner:
    """HF ``generate`` with the same processor and placeholder expansion as the engine."""

    def __init__(self, path: str, front, tokenizer) -> None:
        import transformers as tf

        self.model = tf.AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32).eval()
        self.front, self.tokenizer = front, tokenizer

    @torch.inference_mode()
    def run(self, text: str, image, max_tokens: int) -> list[int]:
        ids, mm = self.front.prepare(self.tokenizer.encode(text), [image])
        t = torch.tensor([ids])
        p = mm.images[0]
        out = self.model.generate(
            input_ids=t, attention_mask=torch.ones_like(t), pixel_values=p.pixel_values,
            image_grid_thw=torch.tensor([p.grid_thw]),
            mm_token_type_ids=(t == self.model.config.image_token_id).int(),
            max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
        return out[0, len(ids):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-layers", type=int, default=24)
    parser.add_argument("--vision-depth", type=int, default=27)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from qwenserve import LLM, SamplingParams

    path = build_checkpoint(args.text_layers, args.vision_depth)
    llm = LLM(path, dtype="float32", max_model_len=1024, mm_processor_cache_gb=0)
    front, tokenizer = llm.llm_engine.image_inputs, llm.get_tokenizer()
    hf = HFRunner(path, front, tokenizer)
    question = tokenizer.apply_chat_template(
        [{"role": "user", "content": front.placeholder + "What is in this picture?"}],
        tokenize=False, add_generation_prompt=True)
    pics = images(args.requests + args.repeats + 1)

    def ours(batch, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt": question, "multi_modal_data": {"image": img}}
                             for img in batch], params)
        return [o.outputs[0].token_ids for o in outs]

    ours(pics[:1], 1), hf.run(question, pics[0], 1)  # warm-up
    ttft_ours, ttft_hf = [], []
    for i in range(args.repeats):
        img = pics[1 + i]  # a new picture each time: no cache helps either side
        start = time.perf_counter()
        ours([img], 1)
        ttft_ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        hf.run(question, img, 1)
        ttft_hf.append(time.perf_counter() - start)
    batch = pics[1 + args.repeats:]
    start, cpu = time.perf_counter(), time.process_time()
    got = ours(batch, args.max_tokens)
    ours_s, ours_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    want = [hf.run(question, img, args.max_tokens) for img in batch]
    hf_s, hf_cpu = time.perf_counter() - start, time.process_time() - cpu
    agree = sum(g == w for g, w in zip(got, want))
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU; text "
          f"layers {args.text_layers} (0.8B: 24), tower depth {args.vision_depth} (27), "
          f"{SIDE}x{SIDE} images")
    print("| measurement | qwenserve | HF | HF / qwenserve |")
    print("|---|---|---|---|")
    mo, mh = statistics.median(ttft_ours), statistics.median(ttft_hf)
    print(f"| TTFT, one image + question (median of {args.repeats}; min) | {mo * 1000:.0f} ms "
          f"({min(ttft_ours) * 1000:.0f}) | {mh * 1000:.0f} ms ({min(ttft_hf) * 1000:.0f}) | "
          f"{mh / mo:.2f}x |")
    n_tok = len(batch) * args.max_tokens
    print(f"| {len(batch)} image requests x {args.max_tokens} tokens (qwenserve at once, HF one "
          f"at a time) | {ours_s:.1f} s, {n_tok / ours_s:.1f} tok/s | {hf_s:.1f} s, "
          f"{n_tok / hf_s:.1f} tok/s | {hf_s / ours_s:.2f}x |")
    print(f"| same, process CPU time | {ours_cpu:.1f} s | {hf_cpu:.1f} s | "
          f"{hf_cpu / ours_cpu:.2f}x |")
    print(f"greedy tokens equal HF for {agree}/{len(batch)} requests")


if __name__ == "__main__":
    main()
