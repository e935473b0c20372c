"""How a step's ``RequestOutput``s cross between processes: flat columns, not objects.

Every step the engine sends each running request's new tokens. Pickled as objects, that is a
``RequestOutput``, a ``CompletionOutput`` and a ``RequestMetrics`` per request per step, plus
the whole prompt again each time: on the tiny test model with 64 streams it cost more CPU than
the rest of the step outside the model, in both processes (docs/benchmarks.md). So the common
output (one completion, still running, no logprobs, nothing pooled or transferred) travels as a
few lists of built-ins, and its prompt does not travel at all: the API process sent it, and
``AsyncEngine.generate`` puts it back (``prompt=None``, ``prompt_token_ids=[]`` until then).
Every other output (a request's last, with logprobs, pooled, ...) travels whole, in its place.

    outputs [a, b, X, c]  ->  ids [a, b, c], indexes, texts, token counts, flat token ids,
                              arrival times, cached-token counts;  whole [(2, X)]
"""

from __future__ import annotations

from qwenserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

# (request ids, completion indexes, texts, new-token counts, new token ids (flat),
#  arrival times, cached-token counts): one entry per output, token ids one per token
Columns = tuple[list[str], list[int], list[str], list[int], list[int], list[float], list[int]]
Packed = tuple[Columns, list[tuple[int, RequestOutput]]]


def pack_outputs(outputs: list[RequestOutput]) -> Packed:
    ids: list[str] = []
    indexes: list[int] = []
    texts: list[str] = []
    counts: list[int] = []
    tokens: list[int] = []
    arrivals: list[float] = []
    cached: list[int] = []
    whole: list[tuple[int, RequestOutput]] = []
    for position, out in enumerate(outputs):
        if not _is_plain(out):
            whole.append((position, out))
            continue
        comp = out.outputs[0]
        ids.append(out.request_id)
        indexes.append(comp.index)
        texts.append(comp.text)
        counts.append(len(comp.token_ids))
        tokens.extend(comp.token_ids)
        arrivals.append(out.metrics.arrival_time)  # type: ignore[union-attr]  # _is_plain
        cached.append(out.num_cached_tokens)
    return (ids, indexes, texts, counts, tokens, arrivals, cached), whole


def unpack_outputs(packed: Packed) -> list[RequestOutput]:
    (ids, indexes, texts, counts, tokens, arrivals, cached), whole = packed
    outputs: list[RequestOutput] = []
    start = 0
    for i, request_id in enumerate(ids):
        end = start + counts[i]
        comp = CompletionOutput(indexes[i], texts[i], tokens[start:end])
        outputs.append(RequestOutput(request_id, None, [], [comp], False,
                                     metrics=RequestMetrics(arrivals[i]),
                                     num_cached_tokens=cached[i]))
        start = end
    for position, out in whole:  # ascending: each goes back where it stood
        outputs.insert(position, out)
    return outputs


def _is_plain(out: RequestOutput) -> bool:
    if out.finished or len(out.outputs) != 1 or out.prompt_logprobs is not None:
        return False
    if out.pooled is not None or out.kv_transfer_params is not None or out.extra:
        return False
    comp, metrics = out.outputs[0], out.metrics
    return (comp.logprobs is None and comp.cumulative_logprob is None
            and comp.finish_reason is None and comp.stop_reason is None
            and metrics is not None and metrics.first_scheduled_time is None
            and metrics.first_token_time is None and metrics.last_token_time is None
            and metrics.finished_time is None and metrics.num_preemptions == 0)


__all__ = ["Packed", "pack_outputs", "unpack_outputs"]
