"""Human-readable rendering of a plan report."""

from __future__ import annotations

GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def render(report: dict) -> str:
    quant = report["quantization"]
    if quant and report.get("quantization_from_checkpoint"):
        quant += " (from the checkpoint)"
    kv = report.get("kv_cache_dtype", "auto")
    lines = [f"Model {report['model']} ({report['architecture']}), {report['dtype']}"
             + (f", {quant} weights" if quant else "")
             + (f", {kv} KV cache" if kv != "auto" else "")
             + f", on {report['device']}; max_model_len {report['max_model_len']:,}, "
             f"target concurrency {report['target_concurrency']}", ""]
    header = (f"{'TP':>3} {'weights/dev':>12} {'KV B/token':>11} {'state B/seq':>12} "
              f"{'activations':>12} {'KV budget':>11} {'KV tokens':>11} {'max conc.':>9} "
              f"{'longest len':>12}")
    lines += [header, "-" * len(header)]
    for p in report["plans"]:
        lines.append(
            f"{p['tp']:>3} {_gib(p['weight_bytes_per_device']):>12} {p['kv_bytes_per_token']:>11,}"
            f" {p['state_bytes_per_sequence']:>12,} {_gib(p['activation_reserve_bytes']):>12} "
            f"{_gib(max(p['kv_cache_budget_bytes'], 0)):>11} "
            f"{p.get('kv_token_capacity', 0):>11,} {p.get('max_concurrency', 0):>9.2f} "
            f"{p['largest_max_model_len']:>12,}")
    head = {p["tp"]: p.get("speculative_head_weight_bytes", 0) for p in report["plans"]}
    if any(head.values()):
        lines.append("Speculative head per device (in weights/dev; its KV layer in KV B/token): "
                     + ", ".join(f"TP={tp} {_gib(b)}" for tp, b in head.items()))
    lines.append("")
    if report["fits"]:
        lines += [f"Fits with --tensor-parallel-size {report['chosen_tp']}.", ""]
        lines += [f"  {cmd}" for cmd in report["commands"].values() if cmd]
        lines += [f"  note: {note}" for note in report.get("notes", [])]
    else:
        lines.append(f"Does not fit: {report['explanation']}")
    return "\n".join(lines)
