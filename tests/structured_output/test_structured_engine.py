"""Structured outputs and the logits processors in the engine, offline (``LLM`` as vLLM's):
outputs that only the mask keeps valid, under n > 1, preemption and a mixed batch; the matcher
rows, the bitmask layout, and the processors against hand-computed expectations."""

from __future__ import annotations

import json
import re

import pytest
import torch

from qwenserve import LLM, SamplingParams, StructuredOutputsParams
from qwenserve.structured_output.request_grammars import RequestGrammars
from qwenserve.worker.sampler import SamplingRow, apply_logits_processors, apply_token_bitmask

SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer",
                                                                   "minimum": 0,
                                                                   "maximum": 99}},
          "required": ["color", "n"]}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("qwen2"), dtype="float32", max_model_len=128,
               max_num_batched_tokens=64, num_gpu_blocks_override=10)


def constrained(**kw) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=so, **kw)


def test_json_under_n_preemption_and_a_mixed_batch(llm):
    free = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    prompts = ["Hello world", "The capital of France", "def add(a, b):", "0123"] * 2
    params = [constrained(n=2, seed=i) if i % 2 else free for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert llm.llm_engine.scheduler.num_preemptions > 0  # 10 blocks cannot hold them all
    for out, p in zip(outs, params):
        for comp in out.outputs:
            if p.structured_outputs is not None:
                value = json.loads(comp.text)
                assert value["color"] in ("red", "green") and 0 <= value["n"] <= 99
            else:
                assert len(comp.token_ids) == 60  # unconstrained rows are not held back


def test_regex_choice_grammar_and_compile_errors(llm):
    so = [StructuredOutputsParams(regex=r"[a-c]{3}\d"), StructuredOutputsParams(choice=["x y", "z"]),
          StructuredOutputsParams(grammar='root ::= "<" [0-9]+ ">"')]
    outs = llm.generate(["Hi"] * 3, [SamplingParams(temperature=1.0, max_tokens=20,
                                                    structured_outputs=s) for s in so])
    assert re.fullmatch(r"[a-c]{3}\d", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("x y", "z")
    assert re.fullmatch(r"<\d+>", outs[2].outputs[0].text)
    with pytest.raises(ValueError, match="Invalid structured outputs regex"):
        llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[")))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", json={})


def test_logits_processors_in_the_engine(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("Hello", SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                               allowed_token_ids=[5, 9]))[0].outputs[0]
    assert set(out.token_ids) <= {5, 9}
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               logit_bias={7: 100.0}))[0].outputs[0]
    assert out.token_ids == [7] * 6
    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    first = tok.decode(greedy[0].outputs[0].token_ids[:1])
    banned = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  bad_words=[first.strip() or first]))
    assert banned[0].outputs[0].token_ids[0] != greedy[0].outputs[0].token_ids[0]
    out = llm.generate({"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(max_tokens=1, truncate_prompt_tokens=5))
    assert out[0].prompt_token_ids == list(range(35, 40))


def test_processors_and_bitmask_on_a_batch():
    logits = torch.zeros(3, 70)
    rows = [SamplingRow(SamplingParams(allowed_token_ids=[1, 64]), [], [], None),
            SamplingRow(SamplingParams(logit_bias={3: 2.5}), [], [8, 9], None),
            SamplingRow(SamplingParams(), [], [8, 9], None)]
    rows[2].params.bad_words_token_ids = [[9, 4], [6], [8, 9, 5], [7, 5]]
    apply_logits_processors(logits, rows)
    assert (logits[0] > -1e30).nonzero().flatten().tolist() == [1, 64]
    assert logits[1, 3] == 2.5 and (logits[1] != 0).sum() == 1
    assert (logits[2] == -float("inf")).nonzero().flatten().tolist() == [4, 5, 6]
    mask = torch.full((3, 3), -1, dtype=torch.int32)
    mask[1] = 0
    mask[1, 0], mask[1, 2] = 1 << 3, 1 << 1  # tokens 3 and 65
    logits = torch.zeros(3, 70)
    apply_token_bitmask(logits, mask)
    assert (logits[1] > -1e30).nonzero().flatten().tolist() == [3, 65]
    assert (logits[0] == 0).all() and (logits[2] == 0).all()


def test_reasoning_gate_and_budget_rows():
    """The gate opens when the output ends with the end tag; the budget forces the tag's tokens,
    continuing a tag the model already began."""
    grammars = RequestGrammars(lambda: None)  # no grammar: the service is never needed
    params = SamplingParams(thinking_token_budget=3)
    params.reasoning_end_token_ids = [50, 51]
    grammars.add("a", params, [])
    assert grammars.bitmask(["a"], 64) is None
    for t in (1, 2, 50):
        grammars.accept("a", t)  # three reasoning tokens, the last starting the tag
    mask = grammars.bitmask(["a"], 64)
    assert mask[0, 1] == 1 << (51 - 32) and mask[0, 0] == 0  # only 51 may follow
    grammars.accept("a", 51)
    assert grammars.bitmask(["a"], 64) is None  # reasoning over, no grammar
    params0 = SamplingParams(thinking_token_budget=0)
    params0.reasoning_end_token_ids = [63]
    grammars.add("b", params0, [])
    assert grammars.bitmask(["x", "b"], 64)[1, 1] == -(2**31)  # token 63: bit 31 of word 1
