"""Throughput cost of structured outputs: one offline batch where half the requests follow a JSON
schema, against the same batch with no constraint, side by side in one process.

Both batches generate exactly the same number of tokens: every request has ``ignore_eos`` and
``max_tokens``, and the schema (an array of at least 40 small objects) cannot be complete before
``max_tokens``, so constrained rows stay constrained to the end. Rounds alternate A-B-B-A (load
from other processes drifting over time hits both alike); the figures are medians. The grammar
compiles once before the rounds (its time is reported apart; later requests hit the cache).

    python benchmarks/structured_outputs.py --threads 1              # embedded SmolLM2-135M
    python benchmarks/structured_outputs.py --shape qwen2.5-0.5b     # Qwen's 152k vocabulary
    python benchmarks/structured_outputs.py --shape tiny-152k        # worst case: ~1 ms steps

``tiny-152k`` has Qwen's tokenizer and vocabulary on a 2-layer, hidden-64 model: its forward pass
is nearly free, so what the grammar costs per token (bitmask fill, apply, matcher advance) shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"],
    },
}
PROMPT = "List the people in the team as JSON:"
TINY_152K = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True, max_position_embeddings=4096)


def run_batch(llm, num_requests: int, max_tokens: int, constrained: bool, seed: int) -> float:
    from qwenserve import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=max_tokens,
                             ignore_eos=True,
                             structured_outputs=so if constrained and i % 2 else None)
              for i in range(num_requests)]
    start = time.perf_counter()
    outs = llm.generate([f"{PROMPT} ({i})" for i in range(num_requests)], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    if constrained:  # the constrained rows are a prefix of a valid document
        text = outs[1].outputs[0].text.lstrip()
        assert text.startswith("["), text[:80]
    return num_requests * max_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    parser.add_argument("--shape", default=None, help="random weights of a published shape "
                        "(benchmarks/common.py SHAPES) with Qwen's tokenizer")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="OpenMP threads (1 is the fair setting on a contended CPU: see "
                        "docs/benchmarks.md, serving overhead)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from qwenserve import LLM, SamplingParams, StructuredOutputsParams

    model = args.model
    if args.shape == "tiny-152k":
        from common import random_model

        model = random_model("tiny-152k-random", "qwen2", **TINY_152K)
    elif args.shape:
        from common import shaped_model

        model = shaped_model(args.shape)
    llm = LLM(model, max_model_len=1024, max_num_seqs=args.num_requests)
    start = time.perf_counter()
    llm.generate("warm-up", SamplingParams(max_tokens=4, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA))))
    compile_s = time.perf_counter() - start
    run_batch(llm, args.num_requests, 8, True, 999)  # first-seen batch shapes are slow on CPU
    run_batch(llm, args.num_requests, 8, False, 999)
    free, half = [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for constrained in order:
            tps = run_batch(llm, args.num_requests, args.max_tokens, constrained, 100 * r)
            (half if constrained else free).append(tps)
            print(f"round {r}: {'half constrained' if constrained else 'unconstrained'} "
                  f"{tps:.1f} tok/s", file=sys.stderr, flush=True)
    result = {
        "model": model or "SmolLM2-135M-Instruct (embedded)",
        "vocab_size": llm.llm_engine.config.model.vocab_size,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "first_compile_and_warmup_s": round(compile_s, 2),
        "unconstrained_tok_s": [round(x, 1) for x in free],
        "half_constrained_tok_s": [round(x, 1) for x in half],
        "median_unconstrained_tok_s": round(statistics.median(free), 1),
        "median_half_constrained_tok_s": round(statistics.median(half), 1),
        "ratio": round(statistics.median(half) / statistics.median(free), 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
