"""MTP speculative decoding on tiny random Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints with
``mtp.*`` tensors (``helpers.tiny_models.add_mtp_head``).

- greedy output identical to plain decoding, batched with mixed prompt lengths, chunked prefill
  (16-token budget) and prefix caching;
- the head's catch-up pass against a plain-PyTorch reference written here from the formula
  (transformers' decoder layer for the layer itself): which hidden state feeds it (the target's,
  after its final norm), the concat order, the shifted tokens, the positions;
- a rigged head (the head runs, its proposals are the target's own continuation): acceptance
  near 100%, still identical, under forced preemption, prefix-cache hits, n > 1, stop strings
  and max_tokens ending mid-draft; the metrics count it;
- refusals: no mtp.* tensors, an architecture without a head. TP=2: ``test_spec_tp.py``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.spec_decode import gen as _gen
from helpers.spec_decode import ids, rig, totals
from helpers.spec_decode import spec_llm as _llm
from helpers.tiny_models import add_mtp_head, hf_mtp_layer, load_hf_model
from qwenserve import SamplingParams

PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(10, 40)), [7, 300, 12, 7, 300, 12, 7],
           list(range(100, 130)) + list(range(100, 110))]
MAX_TOKENS = 20
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
MTP = {"method": "qwen3_5_mtp", "num_speculative_tokens": K}


def gen(llm, params, prompts=PROMPTS):
    return _gen(llm, params, prompts)


@pytest.fixture(scope="module")
def mtp_path(tiny_model):
    def build(arch):
        return add_mtp_head(tiny_model(arch, mtp_num_hidden_layers=1))
    return build


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe",
                                  pytest.param("qwen3_next", marks=pytest.mark.benchmark)])
def test_greedy_identical_and_head_matches_reference(mtp_path, arch):
    path = mtp_path(arch)
    expected = ids(gen(_llm(path), GREEDY))
    spec = _llm(path, speculative_config=MTP)
    head = spec.llm_engine.executor.worker.runner.proposer.head
    calls = []
    forward = head.forward

    def recording(input_ids, positions, hidden, batch, caches):
        out = forward(input_ids, positions, hidden, batch, caches)
        calls.append((input_ids.clone(), positions.clone(), hidden.clone(), out.clone()))
        return out

    head.forward = recording
    prompt = PROMPTS[1]
    first = ids(gen(spec, SamplingParams(temperature=0, max_tokens=1), [prompt]))[0]
    head.forward = forward
    # One prefill chunk (9 tokens <= the 16-token budget): the catch-up covers positions
    # 0..8 with tokens 1..8 and then the sampled token.
    input_ids, positions, hidden, out = calls[0]
    assert positions.tolist() == list(range(len(prompt)))
    assert input_ids.tolist() == prompt[1:] + first
    ref_hidden, ref_out = _reference(path, prompt, first, hidden)
    # The head's input is the target's output after its final norm (HF's last_hidden_state;
    # the MoE target differs from HF's by float32 rounding), and its output follows the formula.
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)

    assert ids(gen(spec, GREEDY)) == expected
    drafts, draft_tokens, accepted = totals(spec)
    assert drafts > 0 and draft_tokens >= drafts and accepted <= draft_tokens
    for _ in range(2):  # a hybrid model's first repeat saves the state checkpoint it hits next
        assert ids(gen(spec, GREEDY, PROMPTS[4:])) == expected[4:]
    assert spec.llm_engine.cache.stats.hits > 0


def _zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@torch.no_grad()
def _reference(path, prompt, sampled, hidden):
    """HF's final (normed) hidden states of the prompt, and the head's formula applied to
    ``hidden``: norm(layer(fc(cat[norm_e(embed(t[i+1])), norm_h(h[i])]))), the layer at
    positions i."""
    from safetensors.torch import load_file

    hf = load_hf_model(path)
    tensors = {k[4:]: v for k, v in load_file(f"{path}/model.safetensors").items()
               if k.startswith("mtp.")}
    h = hf.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    e = hf.model.embed_tokens(torch.tensor(prompt[1:] + sampled))
    x = torch.cat([_zc_norm(e, tensors["pre_fc_norm_embedding.weight"]),
                   _zc_norm(hidden, tensors["pre_fc_norm_hidden.weight"])], dim=-1)
    x = x @ tensors["fc.weight"].T
    layer = hf_mtp_layer(path)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items()
                           if k.startswith("layers.0.")})
    layer.eval()
    pos = torch.arange(len(prompt))[None]
    rope_ids = pos[None].expand(3, 1, -1) if "Qwen3_5" in type(hf).__name__ else pos
    cos_sin = hf.model.rotary_emb(x[None], rope_ids)
    y = layer(x[None], position_embeddings=cos_sin, position_ids=pos)
    y = y[0] if isinstance(y, tuple) else y
    return h, _zc_norm(y[0], tensors["norm.weight"])


@pytest.fixture(scope="module")
def rigged(mtp_path):
    """Qwen3.5 with a 5-block KV cache of 16 tokens (five requests of up to 60 tokens do not fit
    at once: preemption) and the rigged head."""
    path = mtp_path("qwen3_5")
    plain = _llm(path)
    expected = ids(gen(plain, SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K + 1,
                                             ignore_eos=True)))
    spec = _llm(path, max_model_len=64, speculative_config=MTP, num_gpu_blocks_override=5)
    rig(spec.llm_engine.executor.worker.runner.proposer,
        {tuple(p): e for p, e in zip(PROMPTS, expected)})
    return plain, spec, [e[:MAX_TOKENS] for e in expected]


def test_rigged_head_accepts_and_stays_identical(rigged):
    plain, spec, expected = rigged
    before = totals(spec)
    assert ids(gen(spec, GREEDY)) == expected
    drafts, draft_tokens, accepted = (a - b for a, b in zip(totals(spec), before))
    assert accepted / draft_tokens > 0.95
    assert spec.llm_engine.scheduler.num_preemptions > 0
    per_pos = spec.llm_engine.scheduler.spec_totals.num_accepted_tokens_per_pos
    assert len(per_pos) == K and per_pos[0] > 0


def test_rigged_prefix_hits_n_stop_and_max_tokens(rigged):
    plain, spec, expected = rigged
    for _ in range(2):  # the first repeat saves the state checkpoint the second one hits
        again = gen(spec, GREEDY, PROMPTS[2:3])
        assert ids(again) == expected[2:3]
    assert again[0].num_cached_tokens > 0
    out = gen(spec, SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS,
                                   ignore_eos=True), PROMPTS[:1])[0]
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 2
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert ids(gen(spec, params)) == [e[:max_tokens] for e in expected]
    text = gen(plain, GREEDY)[2].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[text[4:7]])
    a, b = gen(spec, params), gen(plain, params)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]


def test_seeded_sampling_is_reproducible(rigged):
    _, spec, _ = rigged
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7)
    assert ids(gen(spec, params)) == ids(gen(spec, params))


def test_refusals(tiny_model, mtp_path):
    with pytest.raises(ValueError, match="no mtp.* tensors"):
        _llm(tiny_model("qwen3_5"), speculative_config=MTP)
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        _llm(tiny_model("qwen2"), speculative_config={"method": "mtp"})
