"""Batched sampling on device: penalties, temperature, min_p, top_k/top_p, seeded draws, logprobs.

Order (as vLLM): logprobs from the raw logits; then the logits processors (min_tokens,
allowed_token_ids, bad_words, logit_bias), the structured-output token bitmask, and penalties;
greedy rows take the argmax; the others are scaled by temperature, truncated by min_p, top_k and top_p, and
drawn with the exponential race ``argmax(p / E)``, E ~ Exp(1). A request with a ``seed`` draws its
E from its own generator, so its samples do not depend on what else is in the batch.

A platform's ``SamplingKernel`` (``native/csrc/sampling.cpp`` on CPU) replaces the draw: the same
truncations, then an inverse-CDF search with one uniform per row from the same generators, reading
the logits in place (the PyTorch draw sorts and noises the whole vocabulary: seconds per step at
64 rows of a 152k vocabulary on a small CPU, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenserve.core.sched_output import SampledToken
from qwenserve.layers.backends import SamplingKernel
from qwenserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits: the request's parameters and the history penalties look at."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: torch.Generator | None = None,
           bitmask: torch.Tensor | None = None,
           kernel: SamplingKernel | None = None) -> list[SampledToken]:
    """logits [B, V] float32, or the LM head's bf16 / fp16 (widened to float32 only for an
    edit, the PyTorch draw or the PyTorch logprobs) -> one SampledToken per row. ``bitmask``
    [B, ceil(V / 32)] int32: the grammar's allowed tokens per row (all ones for rows without a
    grammar). ``kernel``: the platform's draw, for the logits it ``supports``."""
    logprobs, logits = process_logits(logits, rows, bitmask, kernel)
    if kernel is not None and kernel.supports(logits):
        token_ids = _draw_with_kernel(kernel, logits, rows, default_generator)
    else:
        token_ids = _choose(logits.float(), rows, default_generator)
    return package(token_ids, logprobs, rows)


def _draw_with_kernel(kernel: SamplingKernel, logits: torch.Tensor, rows: list[SamplingRow],
                      default_generator: torch.Generator | None) -> torch.Tensor:
    """One uniform per random row: seeded rows from their own generator, the rest in one call."""
    params = [r.params for r in rows]
    uniform = torch.zeros(len(rows), dtype=torch.float64)
    shared = [i for i, r in enumerate(rows) if not r.params.greedy and r.generator is None]
    if shared:
        uniform[shared] = torch.rand(len(shared), dtype=torch.float64,
                                     generator=default_generator)
    for i, r in enumerate(rows):
        if not r.params.greedy and r.generator is not None:
            uniform[i] = torch.rand(1, dtype=torch.float64, generator=r.generator)
    return kernel.draw(logits, [0.0 if p.greedy else p.temperature for p in params],
                       [p.top_k for p in params], [p.top_p for p in params],
                       [p.min_p for p in params], uniform)


@dataclass
class Logprobs:
    """The raw logits' log-probabilities, computed for the rows and tokens a response reports
    (``package``): through the platform's kernel where it takes the logits (no [rows, vocab]
    log_softmax: 64 rows of a 152k vocabulary 70 -> a few ms a step), else
    ``torch.log_softmax`` of the float32 rows. Sliced by rows for the speculative verifier."""

    logits: torch.Tensor  # [B, V] raw, as the model produced them
    kernel: SamplingKernel | None = None

    def __getitem__(self, rows: slice) -> Logprobs:
        return Logprobs(self.logits[rows], self.kernel)

    def of(self, row_index: list[int], token_ids: list[int], num_top: int
           ) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
        """Per row: its token's logprob, its rank (1 = likeliest) and the ``num_top`` best
        (id, logprob), most likely first."""
        if self.kernel is not None and self.kernel.supports(self.logits):
            chosen, rank, top_lp, top_id = self.kernel.logprobs(self.logits, row_index,
                                                                token_ids, num_top)
        else:
            lp = torch.log_softmax(self.logits[row_index].float(), dim=-1)  # [n, V]
            ids = torch.tensor(token_ids, device=lp.device).unsqueeze(1)
            chosen = lp.gather(1, ids).squeeze(1)
            rank = (lp > chosen.unsqueeze(1)).sum(dim=1).add_(1)
            top_lp, top_id = lp.topk(num_top, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(top_id.tolist(), top_lp.tolist())]
        return chosen.tolist(), rank.tolist(), top


def process_logits(logits: torch.Tensor, rows: list[SamplingRow],
                   bitmask: torch.Tensor | None = None, kernel: SamplingKernel | None = None
                   ) -> tuple[Logprobs | None, torch.Tensor]:
    """(the raw logits' logprobs when a row asks for them, the logits after the processors,
    the bitmask and the penalties): everything before the draw, shared with the speculative
    verifier (``spec_decode/rejection.py``)."""
    edits = _edits_logits(rows, bitmask)
    logprobs = Logprobs(logits, kernel) if any(r.params.logprobs is not None for r in rows) \
        else None
    widened = logits.dtype != torch.float32 and edits
    if widened:  # bf16 logits: the edits go into a float32 copy
        logits = logits.float()
    if not edits:
        return logprobs, logits  # the draw only reads them: no copy of [B, V]
    if not widened:
        logits = logits.clone()
    _mask_stop_tokens(logits, rows)
    apply_logits_processors(logits, rows)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    _apply_penalties(logits, rows)
    return logprobs, logits


def plain_greedy(rows: list[SamplingRow]) -> bool:
    """Whether every row takes the raw logits' argmax and nothing else: greedy, no logprobs,
    no processor or penalty (the grammar's bitmask is the caller's to rule out). Such a step
    needs the tokens only, which a fused LM head can give without the logits."""
    return (all(r.params.greedy and r.params.logprobs is None for r in rows)
            and not _edits_logits(rows, None))


def _edits_logits(rows: list[SamplingRow], bitmask: torch.Tensor | None) -> bool:
    """Whether a processor, the bitmask or a penalty will write into the logits."""
    if bitmask is not None:
        return True
    for r in rows:
        p = r.params
        if (p.allowed_token_ids or p.bad_words_token_ids or p.logit_bias or p.has_penalties
                or (len(r.output_token_ids) < p.min_tokens and p.all_stop_token_ids)):
            return True
    return False


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Processed logits of random (non-greedy) rows -> the distribution they are drawn from:
    temperature, then min_p, top_k and top_p."""
    scaled = logits / _column([p.temperature for p in params], logits)
    return _truncate(scaled, params).softmax(dim=-1)


def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """``min_tokens``: EOS and stop tokens cannot be sampled until enough tokens exist."""
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens and r.params.all_stop_token_ids:
            ids = [t for t in r.params.all_stop_token_ids if t < logits.shape[1]]
            logits[i, ids] = -float("inf")


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """allowed_token_ids, bad_words and logit_bias, as vLLM's built-in logits processors."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long,
                                device=logits.device)
            allowed = logits[i, keep]
            logits[i] = -float("inf")
            logits[i, keep] = allowed
        if p.bad_words_token_ids:
            banned = _banned_tokens(p.bad_words_token_ids, r.output_token_ids)
            if banned:
                logits[i, [t for t in banned if t < vocab]] = -float("inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype,
                                           device=logits.device)


def _banned_tokens(words: list[list[int]], output: list[int]) -> list[int]:
    """A bad word's last token is banned where the output already ends with the rest of it."""
    return [w[-1] for w in words
            if len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Tokens whose bit is clear get -inf: bit ``t % 32`` of word ``t // 32`` stands for token
    ``t``. Float32 CPU logits go through xgrammar's own CPU kernel (the grammar backend in use:
    64 constrained rows of a 152k vocabulary 75 -> 24 ms a step, the same values); elsewhere
    the bits are unpacked in torch, so any device works."""
    vocab = logits.shape[1]
    constrained = (bitmask != -1).any(dim=1).nonzero().flatten()
    if constrained.numel() == 0:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.is_cpu:
        import xgrammar  # a grammar is in use: xgrammar is loaded already

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab,
                                             indices=constrained.tolist(), backend="cpu")
        return
    words = bitmask.index_select(0, constrained).to(logits.device)  # [C, W]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [C, V]
    rows = logits.index_select(0, constrained.to(logits.device))
    logits[constrained.to(logits.device)] = rows.masked_fill(~allowed, -float("inf"))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties on the tokens each row has seen, and only
    those: the (row, token) pairs of its prompt and output are gathered, penalised and written
    back. Dense [rows, vocab] counts and masks cost 180-290 ms a 64-row step of a 152k
    vocabulary on a 2-core CPU (fresh pages for each temporary), more than the model; the values
    written are the same, op for op in the logits' dtype."""
    index = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not index:
        return
    vocab = logits.shape[1]
    device = logits.device
    # (row, token) keys: the prompt's, then the output's (which also count occurrences)
    prompts = [_in_vocab(rows[i].prompt_token_ids, vocab) for i in index]
    outputs = [_in_vocab(rows[i].output_token_ids, vocab) for i in index]
    owner = torch.tensor(index, dtype=torch.long)
    keys = [owner[j] * vocab + ids for j, ids in enumerate(prompts)]
    out_keys = [owner[j] * vocab + ids for j, ids in enumerate(outputs)]
    num_prompt = sum(k.numel() for k in keys)
    unique, inverse = torch.unique(torch.cat(keys + out_keys), return_inverse=True)
    out_counts = torch.bincount(inverse[num_prompt:], minlength=unique.numel()).to(device)
    row_of, token_of = (unique // vocab).to(device), (unique % vocab).to(device)
    params = [r.params for r in rows]
    rep = _column([p.repetition_penalty for p in params], logits)[row_of, 0]
    freq = _column([p.frequency_penalty for p in params], logits)[row_of, 0]
    presence = _column([p.presence_penalty for p in params], logits)[row_of, 0]
    values = logits[row_of, token_of]
    values = torch.where(values > 0, values / rep, values * rep)
    values = (values - freq * out_counts.float()).to(logits.dtype)
    values = values - presence * (out_counts > 0)
    logits[row_of, token_of] = values


def _in_vocab(token_ids: list[int], vocab: int) -> torch.Tensor:
    """The ids a logit exists for (a placeholder id past the LM head's rows has none)."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    return ids[(ids >= 0) & (ids < vocab)]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _choose(logits: torch.Tensor, rows: list[SamplingRow],
            default_generator: torch.Generator | None) -> torch.Tensor:
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return token_ids
    probs = probabilities(logits[random_rows], [rows[i].params for i in random_rows])
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=rows[i].generator or default_generator)
    token_ids[random_rows] = (probs / noise).argmax(dim=-1)
    return token_ids


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k and top_p on logits already divided by the temperature."""
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _column([p.min_p for p in params], logits)
        logits = logits.masked_fill(probs < threshold, -float("inf"))
    if all(p.top_k == 0 for p in params) and all(p.top_p >= 1.0 for p in params):
        return logits
    vocab = logits.shape[1]
    # ascending, tied logits in descending token order: top_p drops from this end, so among
    # tied tokens at the cut the lowest ids are kept (a stable descending sort's ranking, the
    # native kernel's and the reference's), not whichever an unstable sort left last
    descending, order = logits.sort(dim=-1, descending=True, stable=True)
    sorted_logits, order = descending.flip(-1), order.flip(-1)
    k = torch.tensor([p.top_k or vocab for p in params], device=logits.device).clamp(max=vocab)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - _column([p.top_p for p in params], logits)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def package(token_ids: torch.Tensor, logprobs: Logprobs | None,
            rows: list[SamplingRow]) -> list[SampledToken]:
    ids = token_ids.tolist()
    out = [SampledToken(t) for t in ids]
    wanting = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if logprobs is None or not wanting:
        return out
    num_top = max(rows[i].params.logprobs or 0 for i in wanting)
    chosen, ranks, tops = logprobs.of(wanting, [ids[i] for i in wanting], num_top)
    for i, lp, rank, top in zip(wanting, chosen, ranks, tops, strict=True):
        out[i] = SampledToken(ids[i], lp, rank, top[: rows[i].params.logprobs])
    return out


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], num_top: int,
                    kernel: SamplingKernel | None = None) -> list[SampledToken]:
    """logits [T, V] of consecutive prompt positions -> for each, the logprob and rank of the
    prompt token that follows (``target_ids``) and the ``num_top`` best (raw logits, as vLLM),
    through the platform's kernel where it takes the logits (256 positions of a 152k
    vocabulary: 170-200 -> 21-35 ms)."""
    chosen, ranks, tops = Logprobs(logits, kernel).of(list(range(len(target_ids))), target_ids,
                                                      num_top)
    return [SampledToken(t, lp, r, k)
            for t, lp, r, k in zip(target_ids, chosen, ranks, tops, strict=True)]
