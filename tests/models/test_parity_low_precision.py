"""bfloat16 and float16 end to end: every architecture against Hugging Face in the same dtype,
batched, with chunked prefill, prefix-cache hits and preemption in play.

The tolerance is derived, not picked. A dtype with unit roundoff u (bf16: u = 2^-9, eps 2^-8;
fp16: u = 2^-12) rounds every intermediate result; how far those roundings move a logprob depends
on the model (logit magnitudes, how each layer amplifies an error), so it is measured on the same
model and positions: E = max |HF_dtype - HF_fp32| over every logprob checked, i.e. HF's own error
in this dtype against the (exact to ~1e-6) float32 result. A qwenserve run that is no less
accurate than HF's sits within E of the float32 result too, so by the triangle inequality
|qwenserve - HF_dtype| <= 2E. That is the logprob tolerance, and the token check follows from it:
at every step (both teacher-forced on qwenserve's tokens), qwenserve's greedy token must be HF's
argmax up to 2E, i.e. a flip is allowed only at a near-tie that the dtype cannot resolve.

The routed-expert model (Qwen3-MoE) has the same kind of tail: where its router sits at a
near-tie, one rounding picks another expert and that position's logprobs move by much more than
E. On an AMX Xeon its bf16 run had a median error against float32 of 1.06 times HF's, with the
largest of 0.25 at two positions where HF's largest was 0.09; so it too is held to the median and
mean bound below, not the per-entry one.

Measured on these models (bf16): E ~0.06-0.10 for the dense models with |logits| ~5, where the
final rounding alone is u * |z| ~ 0.01 per logit: errors grow through the layers; qwenserve is
~0.03 from HF, and its mean error against float32 is HF's within 3%.

The hybrid models (Gated DeltaNet) are chaotic in bf16 with random weights, and the maximum over
entries is a tail statistic there, so the per-entry bound above does not apply to them. Measured
(issue 14; prompts of 4 seeds, 320 logprobs each): HF's own bf16 error has a median of 0.08-0.9
nats and a maximum of 0.6-8.4; qwenserve's median/mean error against float32 is 0.54-1.41 times
HF's, on either side of 1 from one prompt set to the next, and which of the two has the larger
maximum is chance (Qwen3-Next, seed 0: qwenserve 6.3, HF 2.2; seed 1: 3.6 and 5.4). The cause:
a DeltaNet layer's output is ~100x smaller than its inputs (fast decay, cancellation), and the
gated RMSNorm scales it back up with its relative rounding error (0.4% in -> ~14% out), after
which MoE routers flip near ties. HF in bf16 does exactly the same. So the hybrids are checked in
two ways instead:
- end to end, for gross errors: qwenserve's median and mean error against float32 are at most
  twice HF's (measured at most 1.41);
- layer by layer, for precision (``test_hybrid_layers_are_as_precise_as_hf``): every token mixer
  and MLP of qwenserve's bf16 run is fed to HF's layer in bf16 and in float32, so no earlier error
  enters; qwenserve's mean local error must be within 25% of HF's (measured 0.89-1.07 for the
  DeltaNet layers; attention and MLP/MoE outputs equal HF's bit for bit).
"""

from __future__ import annotations

import random
import statistics

import pytest
import torch
import transformers as tf

from qwenserve import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
ROUTED_NEAR_TIES = (*HYBRID, "qwen3_moe")  # no per-entry bound (the module docstring)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_TOKENS = 8


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 17, 33, 70)]


def hf_model(path: str, dtype: torch.dtype):
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                   experts_implementation="eager").eval()


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64 logprobs of each generated position, given qwenserve's tokens."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.double(), dim=-1)


# bf16 for every architecture; fp16 for a dense and a hybrid one in CI, all of them as a sweep
# (bf16 and fp16 are emulated on most CPUs: each case takes several seconds)
HYBRID_ERROR_RATIO = 2.0  # end to end: qwenserve's median/mean error over HF's (measured <= 1.41)
LAYER_ERROR_RATIO = 1.25  # layer by layer: qwenserve's mean local error over HF's (<= 1.07)
CASES = [pytest.param(arch, "bfloat16", id=f"{arch}-bfloat16") for arch in ARCHS] + [
    pytest.param(arch, "float16", id=f"{arch}-float16",
                 marks=() if arch in ("qwen3", "qwen3_5") else pytest.mark.benchmark)
    for arch in ARCHS]


@pytest.mark.parametrize(("arch", "dtype"), CASES)
def test_low_precision_matches_hf_in_the_same_dtype(tiny_model, arch, dtype):
    path = tiny_model(arch)
    batch = prompts(ARCHS.index(arch))
    # 16-token budget (hybrid models: 32): chunked prefill; 8 blocks of 16 (hybrid models: 10,
    # so that state checkpoints survive for the second round) cannot hold the four sequences
    # (11 blocks at full length): preemption; the second round hits the prefix cache. (Hybrid
    # prefills no longer stop at their checkpoints: with 16 tokens a step too few sequences
    # grew at once to preempt.)
    hybrid = arch in HYBRID
    llm = LLM(path, dtype=dtype, max_model_len=128, max_num_batched_tokens=32 if hybrid else 16,
              num_gpu_blocks_override=10 if hybrid else 8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    rounds = [llm.generate([{"prompt_token_ids": p} for p in batch], params) for _ in range(2)]
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0 and engine.cache.stats.hits > 0
    assert engine.cache.usage() == 0.0
    hf_low, hf_fp32 = hf_model(path, DTYPES[dtype]), hf_model(path, torch.float32)
    checks = []  # (qwenserve's logprobs, HF's in dtype, HF's in fp32, tokens) per output
    for outs in rounds:
        for prompt, out in zip(batch, outs, strict=True):
            tokens = out.outputs[0].token_ids
            assert len(tokens) == MAX_TOKENS
            checks.append((out.outputs[0].logprobs, teacher_forced_logprobs(hf_low, prompt, tokens),
                           teacher_forced_logprobs(hf_fp32, prompt, tokens), tokens))
    hf_errors = [abs(low[step, t] - exact[step, t]).item() for entries, low, exact, _ in checks
                 for step, entry in enumerate(entries) for t in entry]
    our_errors = [abs(lp.logprob - exact[step, t].item()) for entries, _, exact, _ in checks
                  for step, entry in enumerate(entries) for t, lp in entry.items()]
    tolerance = 2 * max(hf_errors)
    for entries, low, _, tokens in checks:
        for step, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
            if arch not in ROUTED_NEAR_TIES:  # their maximum is chance: the module docstring
                for t, lp in entry.items():
                    assert abs(lp.logprob - low[step, t].item()) <= tolerance, (step, t, tolerance)
            assert low[step, token] >= low[step].max() - tolerance, (step, token, tolerance)
    for stat in (statistics.median, statistics.fmean):
        ratio = stat(our_errors) / stat(hf_errors)
        assert ratio <= HYBRID_ERROR_RATIO, (stat.__name__, ratio, stat(hf_errors))


# ---- hybrid models: each layer's own rounding, on identical inputs -----------------------------
LAYER_KINDS = ("linear_attn", "self_attn", "mlp")


def _capture(layers, store: dict, x_arg: dict[str, int]) -> list:
    """Forward hooks recording (input hidden states, output, args, kwargs) of each layer's token
    mixer and MLP, keyed (layer, kind)."""
    handles = []
    for i, layer in enumerate(layers):
        for kind in LAYER_KINDS:
            module = getattr(layer, kind, None)
            if module is None:
                continue

            def hook(mod, args, kwargs, out, key=(i, kind)):
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[x_arg[key[1]]]
                store[key] = (x.detach(), (out[0] if isinstance(out, tuple) else out).detach(),
                              args, kwargs)
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return handles


@torch.no_grad()
def _replay(module, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """HF's ``module`` on hidden states ``x`` [T, H], with the other arguments of its own call
    (attention mask, position embeddings) from a full forward pass over the same prompt."""
    x = x.reshape(1, -1, x.shape[-1])
    if "hidden_states" in kwargs:
        out = module(*args, **{**kwargs, "hidden_states": x})
    else:
        out = module(x, *args[1:], **kwargs)
    return (out[0] if isinstance(out, tuple) else out)[0].float()


def layer_local_errors(path: str, dtype: str, prompt: list[int]) -> dict[str, tuple[float, float]]:
    """Per kind of layer: (qwenserve's mean local error, HF's), each against HF's float32 layer
    run on the same input. qwenserve's layer input is given to HF's layer in ``dtype`` and in
    float32, so no error from earlier layers enters the comparison: only the layer's own ops."""
    llm = LLM(path, dtype=dtype, max_model_len=128, max_num_batched_tokens=128,
              enable_prefix_caching=False)
    ours: dict = {}
    model = llm.llm_engine.executor.worker.model
    handles = _capture(model.model.layers, ours, {"linear_attn": 0, "self_attn": 1, "mlp": 0})
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    for h in handles:
        h.remove()
    hf = {torch.float32: hf_model(path, torch.float32), DTYPES[dtype]: hf_model(path, DTYPES[dtype])}
    calls: dict = {}
    for dt, m in hf.items():
        calls[dt] = {}
        handles = _capture(m.model.layers, calls[dt], {k: 0 for k in LAYER_KINDS})
        with torch.no_grad():
            m(torch.tensor([prompt]), use_cache=False)  # replays must not continue a state
        for h in handles:
            h.remove()
    sums: dict[str, list[float]] = {kind: [0.0, 0.0] for kind in LAYER_KINDS}
    for (i, kind), (x, out, _, _) in ours.items():
        exact = _replay(getattr(hf[torch.float32].model.layers[i], kind), x.float(),
                        *calls[torch.float32][(i, kind)][2:])
        low = _replay(getattr(hf[DTYPES[dtype]].model.layers[i], kind), x,
                      *calls[DTYPES[dtype]][(i, kind)][2:])
        sums[kind][0] += (out.float() - exact).abs().mean().item()
        sums[kind][1] += (low - exact).abs().mean().item()
    return {kind: (a, b) for kind, (a, b) in sums.items() if b > 0}


@pytest.mark.parametrize("arch", HYBRID)
def test_hybrid_layers_are_as_precise_as_hf(tiny_model, arch):
    """No op of qwenserve's bf16 layers is done at a lower precision than HF's (the end-to-end
    check cannot tell on chaotic random hybrids; see the module docstring)."""
    rng = random.Random(ARCHS.index(arch))
    errors = layer_local_errors(tiny_model(arch), "bfloat16",
                                [rng.randrange(3, 512) for _ in range(48)])
    assert set(errors) == set(LAYER_KINDS)
    for kind, (ours, hf) in errors.items():
        assert ours <= LAYER_ERROR_RATIO * hf, (kind, ours, hf)
