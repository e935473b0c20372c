"""Speculative decoding through the offline API on a tiny random model: greedy output is
identical to plain decoding, token for token, whatever the drafts (ngram, rigged to the
target's own continuation, or wrong), with chunked prefill, prefix caching, preemption (a
small KV cache), n > 1, stop strings, max_tokens ending mid-draft and logprobs."""

from __future__ import annotations

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.metrics.stats import SpecDecodingStats

PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(10, 40)), [7, 300, 12, 7, 300, 12, 7],
           list(range(100, 130)) + list(range(100, 110))]
MAX_TOKENS = 24
K = 3


def _llm(path, **kw):
    return LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
               block_size=16, **kw)


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def plain(model_path):
    return _llm(model_path)


@pytest.fixture(scope="module")
def spec(model_path):
    """ngram drafts, and a KV cache of 10 blocks of 16 tokens: five requests of up to 64
    tokens do not fit at once, so requests are preempted and recomputed."""
    return _llm(model_path, num_gpu_blocks_override=10,
                speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})


def gen(llm, params, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(plain):
    return ids(gen(plain, GREEDY))


class Rigged:
    """Proposes the target's own greedy continuation (``wrong_at``: with token j replaced),
    so the acceptance path is exercised on random weights."""

    def __init__(self, expected, wrong_at=None):
        self.next = {tuple(p): out for p, out in zip(PROMPTS, expected)}
        self.wrong_at = wrong_at

    def forward(self, batch, hidden=None, chunks=()):
        pass

    def propose(self, request_ids, requests):
        out = {}
        for rid in request_ids:
            state = requests[rid]
            done = len(state.output_token_ids)
            draft = list(self.next[tuple(state.prompt_token_ids)][done : done + K])
            if self.wrong_at is not None and len(draft) > self.wrong_at:
                draft[self.wrong_at] = (draft[self.wrong_at] + 1) % 512
            if draft:
                out[rid] = draft
        return out


@pytest.fixture
def runner(spec):
    runner = spec.llm_engine.executor.worker.runner
    ngram = runner.proposer
    yield runner
    runner.proposer = ngram


def spec_stats(llm, before=None):
    """Counters since ``before`` (a copy of the scheduler's totals)."""
    totals = llm.llm_engine.scheduler.spec_totals
    if before is None:
        return SpecDecodingStats(**{k: list(v) if isinstance(v, list) else v
                                    for k, v in vars(totals).items()})
    pos = [a - (before.num_accepted_tokens_per_pos[i]
                if i < len(before.num_accepted_tokens_per_pos) else 0)
           for i, a in enumerate(totals.num_accepted_tokens_per_pos)]
    return SpecDecodingStats(totals.num_drafts - before.num_drafts,
                             totals.num_draft_tokens - before.num_draft_tokens,
                             totals.num_accepted_tokens - before.num_accepted_tokens, pos)


@pytest.mark.parametrize("proposer", ["ngram", "rigged", "rigged_wrong_1", "rigged_wrong_0"])
def test_greedy_identical(spec, runner, expected, proposer):
    if proposer != "ngram":
        wrong = None if proposer == "rigged" else int(proposer[-1])
        runner.proposer = Rigged(expected, wrong)
    before = spec_stats(spec)
    assert ids(gen(spec, GREEDY)) == expected
    stats = spec_stats(spec, before)
    assert stats.num_drafts > 0
    assert spec.llm_engine.scheduler.num_preemptions > 0  # the small cache forced some
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    if proposer == "rigged":
        assert rate > 0.95
        assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts
    if proposer == "rigged_wrong_0":
        assert stats.num_accepted_tokens == 0


def test_prefix_cache_hits_and_n(spec, runner, expected, plain):
    runner.proposer = Rigged(expected)
    first = ids(gen(spec, GREEDY, PROMPTS[2:3]))
    again = gen(spec, GREEDY, PROMPTS[2:3])
    assert again[0].num_cached_tokens > 0
    assert ids(again) == first == expected[2:3]
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = gen(spec, params, PROMPTS[:1])[0]
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 2


def test_max_tokens_and_stop_mid_draft(spec, runner, expected, plain):
    runner.proposer = Rigged(expected)
    for max_tokens in (1, 2, 5, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert ids(gen(spec, params)) == [e[:max_tokens] for e in expected]
    stop_id = expected[1][5]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id])
    assert ids(gen(spec, params)) == ids(gen(plain, params))
    text = gen(plain, GREEDY)[2].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[text[4:7]])
    a, b = gen(spec, params), gen(plain, params)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]


def test_logprobs_of_accepted_tokens(spec, runner, expected, plain):
    runner.proposer = Rigged(expected)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    a, b = gen(spec, params, PROMPTS[:2]), gen(plain, params, PROMPTS[:2])
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert list(lx) == list(ly)
            assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 for t in lx)


def test_seeded_sampling_runs_and_is_reproducible(spec, runner, expected):
    runner.proposer = Rigged(expected)
    params = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=3)
    assert ids(gen(spec, params)) == ids(gen(spec, params))


@pytest.mark.parametrize("arch", ["qwen3_5", pytest.param("qwen3_next",
                                                      marks=pytest.mark.benchmark)])
def test_hybrid_models_roll_their_state_back(tiny_model, arch):
    """Gated DeltaNet state after a rejection is recomputed over the kept tokens: greedy
    output equals plain decoding with drafts right, wrong at 1 and wrong at 0, under prefix
    caching (state checkpoints) and chunked prefill."""
    path = tiny_model(arch)
    plain = _llm(path)
    prompts = PROMPTS[:3]
    expected = ids(gen(plain, GREEDY, prompts))
    spec = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": K})
    runner = spec.llm_engine.executor.worker.runner
    for wrong_at in (None, 1, 0):
        runner.proposer = Rigged(expected, wrong_at)
        assert ids(gen(spec, GREEDY, prompts)) == expected, wrong_at
    assert spec.llm_engine.cache.stats.hits > 0
    totals = spec.llm_engine.scheduler.spec_totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
