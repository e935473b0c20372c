"""Decode steps replayed from their recorded native calls (worker/decode_replay.py): the same
tokens and logprobs as eager steps, across block boundaries, preemption and prefix caching;
steps that compute in PyTorch stay eager; ``--enforce-eager`` and ``cudagraph_mode`` NONE switch
it off; ``max_cudagraph_capture_size`` bounds it and ``cudagraph_capture_sizes`` names its sizes."""

from __future__ import annotations

import pytest
import torch

from qwenserve import LLM, SamplingParams
from qwenserve.native import build, native_enabled
from qwenserve.native.elementwise import elementwise
from qwenserve.native.gemm import bgemm, igemm, pbgemm, pigemm
from qwenserve.native.recording import record_calls, replay
from qwenserve.platforms.cpu import CpuPlatform

NATIVE = native_enabled() and build.compiler() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: no native kernels")
# bf16 GEMMs are native calls only on AMX (bgemm) or, without it, AVX512-BF16 (the packed GEMM,
# whose bias - Qwen2's qkv - goes in unconverted so the step stays replayable)
BF16_GEMM_NATIVE = NATIVE and (bgemm() is not None or (
    pbgemm() is not None and CpuPlatform().packed_bf16_gemm()))
# W8A8 GEMMs of 3+ rows are native calls on AMX-INT8 (igemm) or VNNI without it (the packed
# int8 GEMM, with the scaling and the layer's bias in its epilogue)
INT8_GEMM_NATIVE = NATIVE and (igemm() is not None or (
    pigemm() is not None and CpuPlatform().packed_int8_gemm()))

# lengths around the 16-token blocks, so decodes cross into new blocks
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((15, 16, 3, 33))]


def params(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 24):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(max_tokens))
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def replays(llm: LLM):
    return llm.llm_engine.executor.worker.runner.decode_replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_5"])
def test_replayed_steps_give_the_eager_tokens_and_logprobs(tiny_model, arch, dtype):
    """Bit for bit: the replay makes the eager step's kernel calls. With four, then one, then
    three sequences (the batch shrinks as requests finish at different lengths). Qwen3.5: its
    Gated DeltaNet layers advance each sequence's recurrent state in place, replayed or not."""
    path = tiny_model(arch)
    kw = dict(dtype=dtype, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    eager, replayed = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
    assert replays(eager) is None
    for prompts, n in ((PROMPTS, 24), (PROMPTS[:1], 20), (PROMPTS[1:], 30)):
        assert generate(replayed, prompts, n) == generate(eager, prompts, n)
    if NATIVE and (dtype == "float32" or BF16_GEMM_NATIVE):
        assert replays(replayed).replayed_steps > 0
        assert not replays(replayed)._refused  # every batch size's step was replayable
    for llm in (eager, replayed):
        llm.llm_engine.shutdown()


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_w8a8_decode_steps_replay_like_eager(tiny_model, dtype, arch):
    """``--quantization int8``: one and two sequences run the native int8 GEMV with its scales
    and the layer's bias in the kernel, more the AMX-INT8 GEMM where the CPU has it (the packed
    VNNI GEMM on VNNI CPUs without it), so their steps replay too (Qwen3.5's Gated DeltaNet
    projections included)."""
    path = tiny_model(arch)
    kw = dict(dtype=dtype, max_model_len=128, kv_cache_memory_bytes=16 << 20,
              quantization="int8")
    eager, replayed = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
    for prompts in (PROMPTS[:1], PROMPTS[1:3], PROMPTS):
        assert generate(replayed, prompts, 12) == generate(eager, prompts, 12)
    if dtype == "float32" or eager.llm_engine.executor.worker.backends.elementwise is not None:
        assert replays(replayed).replayed_steps > 0
        if INT8_GEMM_NATIVE:
            assert not replays(replayed)._refused  # four sequences' steps replayed too
    for llm in (eager, replayed):
        llm.llm_engine.shutdown()


@needs_native
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_preemption_and_prefix_hits_replay_like_eager(tiny_model, arch):
    """A KV pool too small for all four requests (preempted, recomputed, resumed) and a shared
    prefix: the decode batch changes size and block tables change between replays. Qwen3.5:
    its prefix hits restore recurrent-state checkpoints, and its state slots change too."""
    path = tiny_model(arch)
    shared = PROMPTS[3][:32]
    prompts = [shared + [9, 8], shared + [4], PROMPTS[2], PROMPTS[1]]
    kw = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=9,
              enable_prefix_caching=True)
    eager, replayed = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
    assert generate(replayed, prompts, 40) == generate(eager, prompts, 40)
    assert replays(replayed).replayed_steps > 0
    for llm in (eager, replayed):
        llm.llm_engine.shutdown()


@needs_native
def test_a_step_that_computes_in_pytorch_is_not_replayed(tiny_model, monkeypatch):
    """A decoder whose last norm is followed by a PyTorch op: recording sees the op, the size
    stays eager, and the outputs are still the eager ones."""
    from qwenserve.models.dense import DecoderModel

    path = tiny_model("qwen2")
    run_layers = DecoderModel.run_layers
    monkeypatch.setattr(DecoderModel, "run_layers",
                        lambda self, *a: run_layers(self, *a) * 1.0)
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    eager, llm = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
    assert generate(llm, PROMPTS[:2]) == generate(eager, PROMPTS[:2])
    assert replays(llm).replayed_steps == 0 and 2 in replays(llm)._refused
    for engine in (eager, llm):
        engine.llm_engine.shutdown()


@needs_native
def test_a_vision_language_models_text_steps_replay_and_image_steps_stay_eager(tmp_path):
    """Published Qwen3.5 checkpoints are ``...ForConditionalGeneration``: a decode step with no
    image rows is the text model's layers (recorded and replayed), one whose requests carry an
    image (M-RoPE positions) runs eagerly; both give the eager engine's tokens and logprobs."""
    from helpers.tiny_vision import make_tiny_vl_checkpoint, random_image

    path = make_tiny_vl_checkpoint("qwen3_5", str(tmp_path / "qwen3_5_vl"))
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    eager, replayed = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
    front = replayed.llm_engine.image_inputs
    texts = ["qwenserve serves Qwen models.", "Hi", "paged attention"]
    with_image = {"prompt": "Look: " + front.placeholder + " what is it?",
                  "multi_modal_data": {"image": [random_image(40, 28, seed=3)]}}
    p = params(12)

    def run(llm: LLM, prompts: list) -> list:
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in llm.generate(prompts, p)]

    assert run(replayed, texts) == run(eager, texts)
    assert replays(replayed).replayed_steps > 0
    before = replays(replayed).replayed_steps
    assert run(replayed, [with_image, texts[0]]) == run(eager, [with_image, texts[0]])
    assert replays(replayed).replayed_steps == before  # every step had an image's positions
    for llm in (eager, replayed):
        llm.llm_engine.shutdown()


@needs_native
def test_a_hybrid_replay_that_stops_midway_fails_the_step(tiny_model, monkeypatch):
    """A dense step that a kernel refuses midway runs again eagerly (it rewrites the same K/V);
    a hybrid one cannot (the calls before the refusal advanced recurrent states in place), so
    the step fails with an error naming the kernel instead of advancing them twice."""
    from qwenserve.worker import decode_replay

    llm = LLM(tiny_model("qwen3_5"), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=16 << 20)
    generate(llm, PROMPTS[:2], 8)
    assert 2 in replays(llm)._recordings
    monkeypatch.setattr(decode_replay, "replay", lambda calls: 3)
    with pytest.raises(RuntimeError, match=r"stopped at native call 3 \(.*recurrent state"):
        generate(llm, PROMPTS[:2], 8)
    assert 2 not in replays(llm)._recordings
    llm.llm_engine.shutdown()


@needs_native
def test_vllm_options_switch_it_off_or_bound_it(tiny_model):
    path = tiny_model("qwen2")
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    off = LLM(path, compilation_config={"cudagraph_mode": "NONE"}, **kw)
    assert replays(off) is None
    off.llm_engine.shutdown()
    bounded = LLM(path, compilation_config={"max_cudagraph_capture_size": 2}, **kw)
    generate(bounded, PROMPTS[:3], 8)  # three sequences: above the bound
    assert replays(bounded).replayed_steps == 0
    generate(bounded, PROMPTS[:2], 8)
    assert replays(bounded).replayed_steps > 0
    bounded.llm_engine.shutdown()
    # vLLM Ascend's guides name the captured sizes: only those are recorded (no padding)
    sized = LLM(path, compilation_config={"cudagraph_capture_sizes": [1, 3]}, **kw)
    assert replays(sized).max_batch == 3
    generate(sized, PROMPTS[:2], 8)
    assert replays(sized).replayed_steps == 0
    generate(sized, PROMPTS[:3], 8)
    assert replays(sized).replayed_steps > 0
    sized.llm_engine.shutdown()


@needs_native
def test_recordings_past_their_memory_budget_are_not_kept(tiny_model, monkeypatch):
    from qwenserve.worker import worker

    monkeypatch.setattr(worker, "DECODE_REPLAY_BYTES", 1024)
    llm = LLM(tiny_model("qwen2"), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=16 << 20)
    generate(llm, PROMPTS[:2], 8)
    assert replays(llm).replayed_steps == 0 and 2 in replays(llm)._refused
    llm.llm_engine.shutdown()


@pytest.mark.skipif(not NATIVE or elementwise() is None, reason="no native kernels")
def test_replay_stops_where_a_kernel_refuses_the_new_data():
    """The rotary kernel refuses a position outside its table (status 2): a replay over data
    it now refuses reports it, so the step runs eagerly (and raises there, as it should)."""
    kernels = elementwise()
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    positions = torch.tensor([3])
    with record_calls() as calls:
        kernels.rotary(positions, q, k, cos, sin, 8)
    assert len(calls) == 1 and replay(calls) is None
    positions.fill_(9)
    assert replay(calls) == 0
    with pytest.raises(IndexError, match="outside the table"):
        kernels.rotary(positions, q, k, cos, sin, 8)


def test_recordings_do_not_nest():
    with record_calls(), pytest.raises(RuntimeError, match="already being recorded"):
        with record_calls():
            pass
