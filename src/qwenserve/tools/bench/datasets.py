"""Benchmark prompts: ShareGPT files, random token prompts and repeated-prefix prompts.

Each sampler reproduces vLLM's (``vllm/benchmarks/datasets/``): same pruning, same shuffling, same
random draws in the same order, so with the same tokenizer and ``--seed`` the measured prompts are
the ones ``vllm bench serve`` would send. Warm-up prompts are drawn so that they never change the
measured ones and do not share their prefixes (a shared prefix would let the prefix cache make the
measured requests look faster than they are).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qwenserve.tools.bench.errors import BenchError, first_line
from qwenserve.tools.bench.tokenizer import TokenizerLike

DATASET_NAMES = ("sharegpt", "random", "prefix-repetition")
# Warm-up prompts are drawn with this seed offset; a sweep re-seeds its load points with small
# offsets (seed + i), so a large one keeps warm-up and measured prompts apart.
WARMUP_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: its text, its token count and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """The dataset flags, with vLLM's defaults."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 1000
    seed: int = 0
    disable_shuffle: bool = False
    no_oversample: bool = False
    request_id_prefix: str = ""
    sharegpt_output_len: int | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    prefix_output_len: int = 128


def normalize_name(name: str) -> str:
    """Accept vLLM's ``prefix_repetition`` spelling as well as ``prefix-repetition``."""
    return name.replace("_", "-")


def check_spec(spec: DatasetSpec) -> list[dict[str, Any]] | None:
    """Validate the flags and read a ShareGPT file, before any request is sent.

    Returns the ShareGPT entries (None for synthetic datasets) so the file is parsed once.
    """
    if spec.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {spec.num_prompts}")
    if spec.name == "sharegpt":
        if not spec.path:
            raise BenchError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return load_sharegpt(spec.path)
    if spec.path is not None:
        raise BenchError(
            f"--dataset-name {spec.name} generates its prompts and takes no --dataset-path; "
            "use --dataset-name sharegpt for a file"
        )
    if spec.name == "random" and not 0.0 <= spec.random_range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {spec.random_range_ratio}")
    if spec.name == "prefix-repetition" and spec.num_prompts < spec.num_prefixes:
        raise BenchError(
            f"--num-prompts ({spec.num_prompts}) must be >= "
            f"--prefix-repetition-num-prefixes ({spec.num_prefixes})"
        )
    return None


def load_sharegpt(path: str) -> list[dict[str, Any]]:
    """Entries of a ShareGPT JSON file that have at least two turns, or a one-line error."""
    if not os.path.isfile(path):
        raise BenchError(f"dataset file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchError(f"{path} is not valid JSON: {first_line(e)}") from e
    if not isinstance(data, list):
        raise BenchError(f"{path} is not a ShareGPT file: expected a JSON list of conversations")
    entries = [e for e in data if _is_conversation(e)]
    if not entries:
        raise BenchError(
            f"{path} is not a ShareGPT file: no entry has 'conversations' with two or more "
            "turns of the form {'from': ..., 'value': ...}"
        )
    return entries


def _is_conversation(entry: Any) -> bool:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    return (
        isinstance(turns, list)
        and len(turns) >= 2
        and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2])
    )


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool) -> bool:
    """vLLM's pruning: drop prompts < 4 or > 1024 tokens, outputs < 4, or totals > 2048."""
    too_short = prompt_len < 4 or (not skip_min_output_len_check and output_len < 4)
    return not (too_short or prompt_len > 1024 or prompt_len + output_len > 2048)


def sample_sharegpt(
    entries: list[dict[str, Any]], tokenizer: TokenizerLike, spec: DatasetSpec, count: int
) -> list[SampleRequest]:
    """The first ``count`` valid conversations after vLLM's seeded shuffle."""
    data = list(entries)
    if not spec.disable_shuffle:
        random.Random(spec.seed).shuffle(data)
    samples: list[SampleRequest] = []
    for entry in data:
        if len(samples) >= count:
            break
        prompt = entry["conversations"][0]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=True))
        output_len = spec.sharegpt_output_len
        if output_len is None:
            completion = entry["conversations"][1]["value"]
            output_len = len(tokenizer.encode(completion, add_special_tokens=True))
        if is_valid_sequence(prompt_len, output_len, spec.sharegpt_output_len is not None):
            request_id = f"{spec.request_id_prefix}{len(samples)}"
            samples.append(SampleRequest(prompt, prompt_len, output_len, request_id))
    return samples


def oversample(samples: list[SampleRequest], spec: DatasetSpec) -> list[SampleRequest]:
    """Repeat random samples up to ``num_prompts`` when the file is short (vLLM's rule)."""
    if not samples:
        raise BenchError(
            f"{spec.path}: no conversation passes the length filter (prompt 4-1024 tokens, "
            "output >= 4, total <= 2048); try --sharegpt-output-len"
        )
    if spec.no_oversample or len(samples) >= spec.num_prompts:
        return samples
    rng = random.Random(spec.seed)
    extra = [
        replace(rng.choice(samples), request_id=f"{spec.request_id_prefix}{len(samples) + i}")
        for i in range(spec.num_prompts - len(samples))
    ]
    return samples + extra


def gen_prompt_decode_to_target_len(
    tokenizer: TokenizerLike, token_ids: list[int], target_len: int, rng: Any
) -> tuple[str, list[int]]:
    """Decode, re-encode and pad or cut until the text is ``target_len`` tokens (10 tries).

    Needed because N tokens do not always decode to a text that encodes back to N tokens.
    """
    for tries_left in range(10, -1, -1):
        prompt = tokenizer.decode(token_ids)
        token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        if tries_left == 0 or len(token_ids) == target_len:
            break
        if len(token_ids) < target_len:
            token_ids = token_ids + tokenizer.random_token_ids(rng, target_len - len(token_ids))
        else:
            token_ids = token_ids[:target_len]
    return prompt, token_ids


def random_lengths(
    spec: DatasetSpec, num_special: int, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths drawn uniformly in [L(1-r), L(1+r)], as vLLM does."""
    ratio = spec.random_range_ratio
    real_input = max(0, spec.random_input_len - num_special)
    input_low, input_high = (
        math.floor(real_input * (1 - ratio)),
        math.ceil(real_input * (1 + ratio)),
    )
    output_low = max(math.floor(spec.random_output_len * (1 - ratio)), 1)
    output_high = max(math.ceil(spec.random_output_len * (1 + ratio)), 1)
    if spec.random_prefix_len + input_low < 1:
        raise BenchError(
            "--random-input-len is too small: a prompt could have no token; raise it or lower "
            "--random-range-ratio"
        )
    input_lens = rng.integers(input_low, input_high + 1, size=count)
    output_lens = rng.integers(output_low, output_high + 1, size=count)
    return input_lens, output_lens


def sample_random(tokenizer: TokenizerLike, spec: DatasetSpec, count: int) -> list[SampleRequest]:
    """vLLM's random dataset: a shared random prefix, then consecutive allowed token ids."""
    rng = np.random.default_rng(spec.seed)
    input_lens, output_lens = random_lengths(
        spec, tokenizer.num_special_tokens_to_add(), count, rng
    )
    offsets = rng.integers(0, _offset_bound(tokenizer), size=count)
    allowed = tokenizer.allowed_token_ids()
    prefix: list[int] = []
    if spec.random_prefix_len > 0:
        prefix = allowed[rng.integers(0, len(allowed), size=spec.random_prefix_len)].tolist()
    samples = []
    for i in range(count):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)]
        target = spec.random_prefix_len + int(input_lens[i])
        prompt, ids = gen_prompt_decode_to_target_len(
            tokenizer, prefix + inner.tolist(), target, rng
        )
        request_id = f"{spec.request_id_prefix}{i}"
        samples.append(SampleRequest(prompt, len(ids), int(output_lens[i]), request_id))
    return samples


def _offset_bound(tokenizer: TokenizerLike) -> int:
    """vLLM draws offsets below ``vocab_size``; a server tokenizer only knows its token pool."""
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if size else len(tokenizer.allowed_token_ids())


def sample_prefix_repetition(
    tokenizer: TokenizerLike, spec: DatasetSpec, count: int
) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes, each followed by ``count // num_prefixes`` suffixes."""
    if count < spec.num_prefixes:
        raise BenchError(
            f"prefix-repetition needs at least --prefix-repetition-num-prefixes "
            f"({spec.num_prefixes}) prompts, got {count}"
        )
    state = np.random.RandomState(spec.seed)

    def exact_tokens(length: int) -> list[int]:
        ids = tokenizer.random_token_ids(state, length)
        return gen_prompt_decode_to_target_len(tokenizer, ids, length, state)[1]

    samples = []
    for _ in range(spec.num_prefixes):
        prefix = exact_tokens(spec.prefix_len)
        for _ in range(count // spec.num_prefixes):
            ids = prefix + exact_tokens(spec.suffix_len)
            samples.append(SampleRequest(tokenizer.decode(ids), len(ids), spec.prefix_output_len))
    if not spec.disable_shuffle:
        random.Random(spec.seed).shuffle(samples)
    return [replace(s, request_id=f"{spec.request_id_prefix}{i}") for i, s in enumerate(samples)]


def build_workload(
    spec: DatasetSpec,
    tokenizer: TokenizerLike,
    num_warmup: int,
    sharegpt_entries: list[dict[str, Any]] | None = None,
) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """Measured prompts (identical to vLLM's for the same seed) and separate warm-up prompts."""
    warm_spec = replace(
        spec,
        seed=spec.seed + WARMUP_SEED_OFFSET,
        request_id_prefix=f"{spec.request_id_prefix}warmup-",
    )
    if spec.name == "sharegpt":
        entries = (
            sharegpt_entries if sharegpt_entries is not None else load_sharegpt(spec.path or "")
        )
        pool = sample_sharegpt(entries, tokenizer, spec, spec.num_prompts + num_warmup)
        measured = oversample(pool[: spec.num_prompts], spec)
        # Warm-up takes conversations the measured run does not use; a short file reuses some.
        rest = pool[spec.num_prompts :] or measured
        warmup = [rest[i % len(rest)] for i in range(num_warmup)]
        warmup = [
            replace(r, request_id=f"{warm_spec.request_id_prefix}{i}") for i, r in enumerate(warmup)
        ]
        return measured, warmup
    if spec.name == "random":
        measured = sample_random(tokenizer, spec, spec.num_prompts)
        warmup = sample_random(tokenizer, warm_spec, num_warmup) if num_warmup else []
        return measured, warmup
    if spec.name == "prefix-repetition":
        measured = sample_prefix_repetition(tokenizer, spec, spec.num_prompts)
        warm_count = spec.num_prefixes * math.ceil(max(num_warmup, 1) / spec.num_prefixes)
        warmup = sample_prefix_repetition(tokenizer, warm_spec, warm_count)[:num_warmup]
        return measured, warmup if num_warmup else []
    raise BenchError(
        f"unknown --dataset-name {spec.name!r}; choose one of {', '.join(DATASET_NAMES)}"
    )
