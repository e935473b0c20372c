"""MTP speculative decoding on a small random Qwen3.5-shaped model: what the draft and verify
machinery costs (a random head: acceptance ~0) and what it can give (a rigged head that proposes
the target's own continuation: acceptance ~100%, the upper bound), against plain decoding.

No trained MTP weights are available offline, so the real acceptance rate cannot be measured
here. Engines run in one process, one after the other per batch size, on the same prompts;
greedy outputs are checked identical, so tokens/s compare like for like.

    PYTHONPATH=src python benchmarks/mtp_overhead.py --batch-sizes 1 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from helpers.spec_decode import rig  # noqa: E402
from helpers.tiny_models import add_mtp_head, make_tiny_model  # noqa: E402
from qwenserve import LLM, SamplingParams  # noqa: E402

# Qwen3.5's layout (3 DeltaNet : 1 full attention) at a small width.
SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
             intermediate_size=768, mtp_num_hidden_layers=1)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams
         ) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args()
    k = args.num_speculative_tokens
    path = add_mtp_head(make_tiny_model("qwen3_5", os.path.join(tempfile.mkdtemp(), "m"),
                                        **SHAPE))
    common = dict(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    mtp = {"method": "qwen3_5_mtp", "num_speculative_tokens": k}
    engines = {"plain": LLM(path, **common),
               "mtp_random": LLM(path, speculative_config=mtp, **common),
               "mtp_rigged": LLM(path, speculative_config=mtp, **common)}
    rigged = engines["mtp_rigged"].llm_engine.executor.worker.runner.proposer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    longer = SamplingParams(temperature=0, max_tokens=args.max_tokens + k + 1, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = [[(17 * i + 31 * j) % 4000 + 10 for j in range(args.prompt_len)]
                   for i in range(batch)]
        _, cont = _run(engines["plain"], prompts, longer)
        rig(rigged, {tuple(p): c for p, c in zip(prompts, cont)})
        times, outputs = {}, {}
        for name, llm in engines.items():
            _run(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm
            before = llm.llm_engine.scheduler.spec_totals
            drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
            times[name], outputs[name] = _run(llm, prompts, params)
            after = llm.llm_engine.scheduler.spec_totals
            rate = ((after.num_accepted_tokens - accepted)
                    / max(1, after.num_draft_tokens - drafted))
            rows.append({"batch": batch, "engine": name,
                         "tok_s": round(batch * args.max_tokens / times[name], 2),
                         "vs_plain": round(times["plain"] / times[name], 3),
                         "acceptance": round(rate, 3) if name != "plain" else None})
        assert outputs["mtp_random"] == outputs["plain"] == outputs["mtp_rigged"]
        for row in rows[-3:]:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
