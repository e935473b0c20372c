"""Shared by the speculative-decoding tests and ``benchmarks/mtp_overhead.py``: a small engine,
its greedy token ids and spec counters, and a rigged proposer (the real head runs, its proposals
are the target's own greedy continuation, so drafts are accepted), also in the tensor-parallel
ranks' own processes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from qwenserve import LLM, SamplingParams
from qwenserve.outputs import RequestOutput

# Set (to a JSON file of [prompt, continuation] pairs) in the environment of the rank processes
# of a test that rigs every rank: ``rank_hooks/sitecustomize.py`` reads it at their start.
RIG_ENV = "QWENSERVE_TEST_RIGGED_DRAFTS"
HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_hooks")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spec_llm(path: str, **kw) -> LLM:
    """fp32, 16-token chunks (chunked prefill), 16-token blocks, 128-token contexts."""
    kw = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 16,
          "block_size": 16, **kw}
    return LLM(path, **kw)


def gen(llm: LLM, params: SamplingParams, prompts: Sequence[list[int]]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def totals(llm: LLM) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) so far."""
    t = llm.llm_engine.scheduler.spec_totals
    return t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens


class RiggedChoice:
    """Mixed in before an ``MtpProposer`` subclass: ``choose`` runs the real LM head, then
    proposes ``expected[prompt]``'s next tokens (0 for prompts it does not know)."""

    expected: Mapping[tuple[int, ...], list[int]] = {}

    def choose(self, request_ids, rows, step, requests):
        super().choose(request_ids, rows, step, requests)  # type: ignore[misc]
        out = []
        for rid in request_ids:
            state = requests[rid]
            cont = self.expected.get(tuple(state.prompt_token_ids), [])
            done = len(state.output_token_ids) + step
            out.append(cont[done] if done < len(cont) else 0)
        return out


def rig(proposer: object, expected: Mapping[tuple[int, ...], list[int]]) -> None:
    """Make ``proposer`` (an MTP or EAGLE-3 proposer) propose ``expected``'s continuations."""
    cls = type(proposer)
    if not issubclass(cls, RiggedChoice):
        proposer.__class__ = type(f"Rigged{cls.__name__}", (RiggedChoice, cls), {})
    proposer.expected = dict(expected)  # type: ignore[attr-defined]


def rig_every_rank(monkeypatch, tmp_path, prompts: Sequence[list[int]],
                   continuations: Sequence[list[int]]) -> None:
    """Rig the proposer of every engine built from now on, in this process and in its
    tensor-parallel rank processes (through ``rank_hooks/sitecustomize.py``)."""
    path = os.path.join(str(tmp_path), "rigged.json")
    with open(path, "w") as f:
        json.dump([[list(p), list(c)] for p, c in zip(prompts, continuations, strict=True)], f)
    monkeypatch.setenv(RIG_ENV, path)
    paths = [HOOKS, TESTS, os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    from qwenserve.worker.worker import Worker

    monkeypatch.setattr(Worker, "init_cache", _rigged_init_cache(Worker.init_cache, path))


def install_rig_from_env() -> None:
    """In a rank process started with ``RIG_ENV`` set: rig its worker's proposer."""
    from qwenserve.worker.worker import Worker

    Worker.init_cache = _rigged_init_cache(Worker.init_cache, os.environ[RIG_ENV])


def _rigged_init_cache(init_cache, path: str):
    with open(path) as f:
        expected = {tuple(p): c for p, c in json.load(f)}

    def rigged(self, plan):
        init_cache(self, plan)
        if self.runner.proposer is not None:
            rig(self.runner.proposer, expected)
    return rigged
