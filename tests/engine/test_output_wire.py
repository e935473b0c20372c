"""A step's outputs cross between processes as columns (``output_wire.py``): everything but the
prompt arrives as it left, in order; ``AsyncEngine`` puts the prompt back
(``test_async_engine.py::test_every_output_names_the_prompt_the_engine_ran``)."""

from __future__ import annotations

import pickle

from qwenserve.engine.core_messages import StepOutputs, UtilityResult
from qwenserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _running(request_id: str, text: str, token_ids: list[int], index: int = 0) -> RequestOutput:
    return RequestOutput(request_id, "the prompt", [1, 2, 3],
                         [CompletionOutput(index, text, token_ids)], False,
                         metrics=RequestMetrics(1234.5), num_cached_tokens=16)


def _crossed(step: StepOutputs) -> StepOutputs:
    return pickle.loads(pickle.dumps(step, protocol=5))


def test_running_outputs_cross_as_columns_without_their_prompt() -> None:
    step = StepOutputs([_running("a", " hi", [7]), _running("b", "", [8, 9], index=1),
                        _running("c", "é", [])])
    got = _crossed(step)
    assert [o.request_id for o in got.outputs] == ["a", "b", "c"]
    for sent, came in zip(step.outputs, got.outputs):
        assert came.outputs == sent.outputs
        assert (came.prompt, came.prompt_token_ids) == (None, [])
        assert came.metrics == sent.metrics
        assert came.num_cached_tokens == 16 and not came.finished


def test_other_outputs_cross_whole_and_in_their_place() -> None:
    finished = RequestOutput("done", "p", [4, 5], [CompletionOutput(0, "end", [3], None, None,
                                                                   "length", None)], True,
                             metrics=RequestMetrics(1.0))
    with_logprobs = _running("lp", "x", [11])
    with_logprobs.outputs[0].logprobs = [{11: Logprob(-0.5, 1, "x")}]
    with_logprobs.outputs[0].cumulative_logprob = -0.5
    two = _running("n2", "y", [12])
    two.outputs.append(CompletionOutput(1, "z", [13]))
    step = StepOutputs([finished, _running("a", "1", [1]), with_logprobs, two,
                        _running("b", "2", [2])], errors=[("bad", "why")],
                       failures=[("lost", "pull failed")],
                       results=[UtilityResult(3, True, 7)])
    got = _crossed(step)
    assert [o.request_id for o in got.outputs] == ["done", "a", "lp", "n2", "b"]
    for i in (0, 2, 3):
        assert got.outputs[i] == step.outputs[i]  # prompt and all
    assert (got.errors, got.failures, got.results) == (step.errors, step.failures, step.results)
