"""Images through the engine: greedy tokens and logprobs equal HF ``generate``-style greedy
(full recomputation with HF's own processor inputs and M-RoPE) on a tiny random Qwen3.5
vision-language checkpoint: one image, two of different sizes, image-text-image, batched with
text-only prompts, with chunked prefill cutting images, prefix-cache hits and misses on images,
and under forced preemption."""

from __future__ import annotations

import pytest

from helpers.tiny_vision import hf_vl_greedy, load_hf_vl, make_tiny_vl_checkpoint, random_image
from qwenserve import LLM, SamplingParams

MAX_TOKENS = 6
LOGPROB_TOL = 1e-3  # fp32; the tower's GEMM patch embedding vs HF's Conv3d, then the decoder


def _prompts():
    """(text parts with images in between) -> the cases of the issue, plus text-only ones."""
    a, b = random_image(40, 24, seed=1), random_image(20, 72, seed=2)
    c, d = random_image(33, 33, seed=3), random_image(64, 16, seed=4)
    return {
        "one_image": ["Hello ", a, " what is this?"],
        "two_sizes": ["The capital of France", a, "is Paris", b, "?"],
        "image_text_image": [c, " versus ", d],
        "text_only": ["qwenserve serves Qwen models with paged attention."],
        "text_short": ["Hi"],
    }


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_vl_checkpoint("qwen3_5", str(tmp_path_factory.mktemp("vl") / "qwen3_5"))
    return path, load_hf_vl(path), {}


def engine_prompt(llm, parts):
    front = llm.llm_engine.image_inputs
    text = "".join(p if isinstance(p, str) else front.placeholder for p in parts)
    images = [p for p in parts if not isinstance(p, str)]
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def reference(vl, llm, name, parts):
    """HF's greedy tokens and logprobs for one prompt (cached per prompt name)."""
    path, hf, cache = vl
    if name not in cache:
        front = llm.llm_engine.image_inputs
        text = "".join(p if isinstance(p, str) else front.placeholder for p in parts)
        images = [p for p in parts if not isinstance(p, str)]
        ids = llm.get_tokenizer().encode(text)
        if images:
            ids, mm = front.prepare(ids, images)
            processed = mm.images
        else:
            processed = []
        cache[name] = hf_vl_greedy(hf, ids, processed, MAX_TOKENS)
    return cache[name]


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def check(vl, llm, names, outs):
    prompts = _prompts()
    for name, out in zip(names, outs):
        want_tokens, want_logprobs = reference(vl, llm, name, prompts[name])
        completion = out.outputs[0]
        assert completion.token_ids == want_tokens, name
        got = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert max(abs(g - w) for g, w in zip(got, want_logprobs)) < LOGPROB_TOL, name


SETTINGS = {
    "default": dict(),
    # a 16-token budget (and 16-token encoder budget) cuts prompts and images into chunks
    "chunked": dict(max_num_batched_tokens=16),
    # 8 blocks of 16 tokens cannot hold all five sequences at once: preemption
    "preemption": dict(max_num_batched_tokens=128, num_gpu_blocks_override=8, max_model_len=128),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batched_images_and_text_match_hf(vl, setting):
    llm = LLM(vl[0], dtype="float32", **{"max_model_len": 256, **SETTINGS[setting]})
    prompts = _prompts()
    names = list(prompts)
    chunks = record_chunks(llm)
    outs = llm.generate([engine_prompt(llm, prompts[n]) for n in names], greedy())
    check(vl, llm, names, outs)
    if setting == "chunked":
        assert cut_images(llm, outs, chunks), "no prefill chunk ended inside an image"
    if setting == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.cache.usage() == 0.0
    runner = llm.llm_engine.executor.worker.runner
    assert not runner.encoder_cache.outputs and not runner.encoder_cache.holders


def record_chunks(llm):
    """(request id, start, end) of every prefill chunk the scheduler makes."""
    scheduler, seen = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule

    def spy():
        out = schedule()
        seen.extend((c.request_id, c.start_pos, c.start_pos + len(c.token_ids))
                    for c in out.chunks if len(c.token_ids) > 1)
        return out

    scheduler.schedule = spy
    return seen


def cut_images(llm, outs, chunks) -> bool:
    """Whether some prefill chunk ended strictly inside an image."""
    front = llm.llm_engine.image_inputs
    prompts = _prompts()
    by_id = {}
    for out, name in zip(outs, prompts):
        parts = prompts[name]
        images = [p for p in parts if not isinstance(p, str)]
        if images:
            text = "".join(p if isinstance(p, str) else front.placeholder for p in parts)
            _, mm = front.prepare(llm.get_tokenizer().encode(text), images)
            by_id[out.request_id] = mm.placements
    return any(p.offset < end < p.end for rid, _, end in chunks for p in by_id.get(rid, ()))


def test_prefix_cache_hits_a_shared_image_and_misses_a_different_one(vl):
    llm = LLM(vl[0], dtype="float32", max_model_len=256)
    prompts = _prompts()
    first = llm.generate(engine_prompt(llm, prompts["image_text_image"]), greedy())[0]
    again = llm.generate(engine_prompt(llm, prompts["image_text_image"]), greedy())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    check(vl, llm, ["image_text_image"], [again])
    # the same text and image sizes, another first image: its tokens are the same ids
    other = [random_image(33, 33, seed=30)] + prompts["image_text_image"][1:]
    miss = llm.generate(engine_prompt(llm, other), greedy())[0]
    assert miss.prompt_token_ids == first.prompt_token_ids
    assert miss.num_cached_tokens == 0
    assert miss.outputs[0].token_ids != first.outputs[0].token_ids or (
        miss.outputs[0].logprobs != first.outputs[0].logprobs)


def test_offline_chat_with_image_parts_and_refusals(vl, tmp_path):
    llm = LLM(vl[0], dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 2},
              allowed_local_media_path=str(tmp_path))
    a, b = random_image(40, 24, seed=1), random_image(20, 72, seed=2)
    b.save(tmp_path / "b.png")
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "The capital of France"},
        {"type": "image_pil", "image_pil": a},
        {"type": "text", "text": "is Paris"},
        {"type": "image_url", "image_url": {"url": (tmp_path / "b.png").as_uri()}},
        {"type": "text", "text": "?"}]}]
    by_chat = llm.chat(messages, greedy())[0]
    front = llm.llm_engine.image_inputs
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "\n".join(["The capital of France", front.placeholder,
                                                  "is Paris", front.placeholder, "?"])}],
        tokenize=False, add_generation_prompt=True)  # parts joined by newlines, as vLLM
    by_generate = llm.generate({"prompt": text, "multi_modal_data": {"image": [a, b]}},
                               greedy())[0]
    assert by_chat.prompt_token_ids == by_generate.prompt_token_ids
    assert by_chat.outputs[0].token_ids == by_generate.outputs[0].token_ids
    with pytest.raises(ValueError, match="At most 2 image"):
        llm.generate({"prompt": front.placeholder * 3, "multi_modal_data": {"image": [a] * 3}})
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": a}})
    with pytest.raises(ValueError, match="no images were given"):
        llm.generate(front.placeholder)
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}])


def test_language_model_only_serves_text_and_refuses_images(vl):
    llm = LLM(vl[0], dtype="float32", max_model_len=128, language_model_only=True)
    assert llm.llm_engine.executor.worker.model.visual is None
    out = llm.generate("Hello", greedy())[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    with pytest.raises(ValueError, match="--language-model-only"):
        llm.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>",
                      "multi_modal_data": {"image": random_image(16, 16)}})


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"])
def test_other_families_match_hf(tmp_path_factory, family):
    """Qwen3.5-MoE (same decoder class, MoE layers), Qwen3-VL (Qwen3 decoder, deep-stack
    features) and Qwen3-VL-MoE (the Qwen3-MoE decoder under Qwen3-VL), chunked so that prefill
    chunks cut the images, batched with a text prompt."""
    path = make_tiny_vl_checkpoint(family, str(tmp_path_factory.mktemp("vl") / family))
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    prompts = _prompts()
    names = ["two_sizes", "text_only", "image_text_image"]
    outs = llm.generate([engine_prompt(llm, prompts[n]) for n in names], greedy())
    check((path, load_hf_vl(path), {}), llm, names, outs)


@pytest.mark.usefixtures("one_thread_per_rank")
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_tensor_parallel_2_matches_hf(vl, tmp_path_factory, family):
    """Both ranks run the tower (split by heads) on the pixels the request carries to them."""
    if family == "qwen3_5":
        path, hf = vl[0], vl
    else:
        path = make_tiny_vl_checkpoint(family, str(tmp_path_factory.mktemp("vl") / family))
        hf = (path, load_hf_vl(path), {})
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    prompts = _prompts()
    names = ["two_sizes", "text_only", "image_text_image"]
    try:
        outs = llm.generate([engine_prompt(llm, prompts[n]) for n in names], greedy())
        check(hf, llm, names, outs)
    finally:
        llm.llm_engine.shutdown()
