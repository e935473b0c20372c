"""Engine options from vLLM's flags against Hugging Face on tiny random models: YaRN through
``hf_overrides`` (and the longer context it allows), the Gated DeltaNet state in 16-bit
(``mamba_ssm_cache_dtype``), and ``load_format="dummy"``."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers.tiny_models import hf_greedy, load_hf_model
from qwenserve import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 8] * 7, [42, 7, 300]]
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 1024}}


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def hf_with_overrides(path: str, overrides: dict):
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path)
    for key, value in overrides.items():
        setattr(config, key, {**(getattr(config, key, None) or {}), **value})
    return tf.AutoModelForCausalLM.from_pretrained(path, config=config,
                                                   dtype=torch.float32).eval()


def test_yarn_hf_overrides_match_hf_and_extend_the_context(tiny_model):
    path = tiny_model("qwen3")  # max_position_embeddings 1024, rope_theta 1e6
    hf_yarn, hf_plain = hf_with_overrides(path, YARN), load_hf_model(path)
    with torch.no_grad():  # the reference itself changes, so the comparison can fail
        ids = torch.tensor([PROMPTS[0]])
        assert not torch.allclose(hf_yarn(ids).logits, hf_plain(ids).logits, atol=1e-3)
    llm = LLM(path, dtype="float32", hf_overrides=YARN, kv_cache_memory_bytes=32 << 20)
    assert llm.llm_engine.config.model.max_model_len == 4096  # 1024 x factor 4, as vLLM
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_yarn, p, 10) for p in PROMPTS]
    llm.llm_engine.shutdown()


def test_context_beyond_the_model_needs_yarn(tiny_model):
    with pytest.raises(ValueError, match="hf-overrides"):
        LLM(tiny_model("qwen3"), dtype="float32", max_model_len=4096)


# fp32: 2e-4, as the engine's fp32 GEMMs (native from 8 rows) sum in another order than HF's
# (measured 1.05e-4 on one of 71 positions of this random model)
@pytest.mark.parametrize(("state_dtype", "atol"), [("float32", 2e-4), ("float16", 2e-2),
                                               ("bfloat16", 1e-1)])
def test_deltanet_state_dtype_scores_prompts_like_hf(tiny_model, state_dtype, atol):
    """Prompt logprobs over 16-token chunks (the state crosses each chunk boundary in its cache
    dtype) against HF in fp32: exact-ish in fp32, within the 16-bit rounding otherwise."""
    path = tiny_model("qwen3_5")
    hf = load_hf_model(path)
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16,
              mamba_ssm_cache_dtype=state_dtype, kv_cache_memory_bytes=16 << 20)
    caches = llm.llm_engine.executor.worker.runner.caches
    ssm = [state.ssm for state in caches.state.values()]
    assert ssm and all(s.dtype == getattr(torch, state_dtype) for s in ssm)
    prompt = PROMPTS[0] + list(range(100, 130))  # 72 tokens: 5 chunks
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    want = torch.tensor([float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))])
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    llm.llm_engine.shutdown()


def test_dummy_weights(tiny_model):
    llm = LLM(tiny_model("qwen3"), dtype="float32", max_model_len=128, load_format="dummy",
              kv_cache_memory_bytes=16 << 20)
    params = list(llm.llm_engine.executor.worker.model.parameters())
    assert all(float(p.abs().max()) <= 1e-3 for p in params)  # drawn, not the checkpoint's
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(4))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.shutdown()


@pytest.mark.parametrize(("flag", "declared", "state_dtype"), [
    ("auto", "bfloat16", torch.bfloat16),  # the checkpoint's mamba_ssm_dtype, as vLLM
    ("auto", None, torch.float32),  # none declared: float32 (vLLM: the model dtype)
    ("float32", "bfloat16", torch.float32),  # the flag wins
])
def test_auto_state_dtype_is_the_checkpoints(tiny_model, flag, declared, state_dtype):
    overrides = {"mamba_ssm_dtype": declared} if declared else None
    llm = LLM(tiny_model("qwen3_5"), dtype="bfloat16", max_model_len=128,
              mamba_ssm_cache_dtype=flag, hf_overrides=overrides, kv_cache_memory_bytes=16 << 20)
    caches = llm.llm_engine.executor.worker.runner.caches
    assert {state.ssm.dtype for state in caches.state.values()} == {state_dtype}
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(4))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.shutdown()


def test_a_state_dtype_the_engine_cannot_keep_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="mamba_ssm_dtype='int8'.*--mamba-ssm-cache-dtype"):
        LLM(tiny_model("qwen3_5"), dtype="float32", max_model_len=128,
            hf_overrides={"mamba_ssm_dtype": "int8"}, kv_cache_memory_bytes=16 << 20)


def test_the_flag_named_in_that_refusal_gets_past_it(caplog):
    """The refusal's fix works: a flag's dtype replaces the declared one (logged)."""
    from transformers import PretrainedConfig

    from qwenserve.config import resolve_ssm_cache_dtype

    declared_int8 = PretrainedConfig(mamba_ssm_dtype="int8")
    with caplog.at_level(logging.WARNING, logger="qwenserve"):
        assert resolve_ssm_cache_dtype("bfloat16", declared_int8) == "bfloat16"
    assert "mamba_ssm_dtype=int8; --mamba-ssm-cache-dtype bfloat16 overrides it" in caplog.text
