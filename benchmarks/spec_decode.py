"""Speculative decoding (ngram prompt lookup) on the embedded SmolLM2-135M-Instruct, offline.

Workload: chat requests asking the model to repeat a paragraph, so its output copies the prompt
(the case prompt lookup is for). For each batch size, the same requests run on two engines in
one process, alternately (plain, then ngram), and the best of ``--repeats`` runs is kept, so
the ratio is measured side by side on a shared machine. Greedy decoding: both produce the same
tokens (checked), so tokens/s compare like for like.

    PYTHONPATH=src python benchmarks/spec_decode.py --batch-sizes 1 4 16 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time

from qwenserve import LLM, SamplingParams

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time for three weeks. Late returns cost ten cents per day.",
    "To install the package, run the installer, accept the licence, and choose a folder. The "
    "program then downloads its data files, which takes a few minutes on a fast connection.",
    "Our team meets every Monday to plan the week. We review open issues, assign owners, and "
    "agree on deadlines. Notes from each meeting are shared with everyone by email.",
    "The train from Zurich to Milan leaves at eight fifteen and arrives shortly after noon. "
    "Seats can be reserved online, and bicycles travel free of charge on weekdays.",
]


def _messages(i: int) -> list[dict]:
    text = PARAGRAPHS[i % len(PARAGRAPHS)]
    return [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]


def _run(llm: LLM, batch: int, params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.chat([_messages(i) for i in range(batch)], params)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    plain = LLM(max_model_len=1024)
    fast = LLM(max_model_len=1024, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    _run(plain, 1, params), _run(fast, 1, params)  # warm-up
    rows = []
    for batch in args.batch_sizes:
        best = {"plain": float("inf"), "ngram": float("inf")}
        totals = fast.llm_engine.scheduler.spec_totals
        drafted, accepted, drafts = (totals.num_draft_tokens, totals.num_accepted_tokens,
                                     totals.num_drafts)
        for _ in range(args.repeats):
            t_plain, ids_plain = _run(plain, batch, params)
            t_spec, ids_spec = _run(fast, batch, params)
            assert ids_plain == ids_spec, "greedy outputs differ"
            best["plain"], best["ngram"] = min(best["plain"], t_plain), min(best["ngram"], t_spec)
        tokens = sum(len(t) for t in ids_plain)
        d_tok = totals.num_draft_tokens - drafted
        a_tok = totals.num_accepted_tokens - accepted
        n_drafts = totals.num_drafts - drafts
        row = {"batch": batch, "output_tokens": tokens,
               "plain_tok_s": round(tokens / best["plain"], 1),
               "ngram_tok_s": round(tokens / best["ngram"], 1),
               "speedup": round(best["plain"] / best["ngram"], 2),
               "acceptance_rate": round(a_tok / d_tok, 3) if d_tok else None,
               "mean_acceptance_length": round(1 + a_tok / n_drafts, 2) if n_drafts else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"config": spec, "max_tokens": args.max_tokens, "results": rows}))


if __name__ == "__main__":
    main()
