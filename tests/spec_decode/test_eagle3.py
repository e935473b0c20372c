"""EAGLE-3 speculative decoding: tiny random Qwen3 (4 layers: vLLM's default aux layers 2, 2, 1)
and Qwen3-MoE (3 layers, aux layers 0, 1, 2 from the head's eagle_config) targets with a tiny
random head (``helpers.tiny_models.make_eagle3_head``: a 256-token draft vocabulary, d2t map;
the MoE one with ``norm_before_residual``).

- greedy output identical to plain decoding, batched with mixed prompt lengths, chunked prefill
  (16-token budget) and prefix caching;
- the head's catch-up pass and its first draft against a plain-PyTorch reference written here
  from the formula, on HF's own hidden states of the target (which layers feed it, the concat
  orders, the shifted tokens, the positions, the pre-norm output, d2t);
- a rigged proposer (the head runs, its proposals are the target's own continuation):
  acceptance near 100%, still identical, under forced preemption and prefix-cache hits; the
  metrics count it;
- refusals: a head for another hidden size or vocabulary (both sizes named), no "model", a
  plain model passed as the head. TP=2: ``test_spec_tp.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.spec_decode import gen as _gen
from helpers.spec_decode import ids, rig, totals
from helpers.spec_decode import spec_llm as _llm
from helpers.tiny_models import load_hf_model, make_eagle3_head
from qwenserve import SamplingParams

PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(10, 40)), [7, 300, 12, 7, 300, 12, 7],
           list(range(100, 130)) + list(range(100, 110))]
MAX_TOKENS = 16
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _spec(head):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": K}


def gen(llm, params, prompts=PROMPTS):
    return _gen(llm, params, prompts)


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """arch -> (target path, head path, aux layer ids)."""
    def build(arch):
        if arch == "qwen3":
            target = tiny_model("qwen3", num_hidden_layers=4)
            aux, layer_ids = None, [2, 2, 1]
        else:
            target = tiny_model("qwen3_moe")
            aux = layer_ids = [0, 1, 2]
        head = make_eagle3_head(target, str(tmp_path_factory.mktemp(f"eagle3-{arch}")),
                                aux_layer_ids=aux, norm_before_residual=arch == "qwen3_moe")
        return target, head, layer_ids
    return build


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    """x [T, heads, D], rotate-half RoPE (Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.no_grad()
def _reference(target, head, layer_ids, prompt, sampled):
    """The head's formula on HF's hidden states: p = mlp(n(r)) + r, r = attn(cat[n(e), n(g)]) + g,
    g = fc(cat aux); returns (p [T, H], the first draft in target ids)."""
    from safetensors.torch import load_file

    t = load_file(f"{head}/model.safetensors")
    hf = load_hf_model(target)
    states = hf.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    g = torch.cat([states[i][0] for i in layer_ids], -1) @ t["fc.weight"].T
    e = hf.model.embed_tokens(torch.tensor(prompt[1:] + sampled))
    x = torch.cat([_rms(e, t["midlayer.input_layernorm.weight"]),
                   _rms(g, t["midlayer.hidden_norm.weight"])], -1)
    n, hd = len(prompt), 16
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, 4, hd)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, 2, hd)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, 2, hd)
    pos = torch.arange(n)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1) @ t["midlayer.self_attn.o_proj.weight"].T
    with open(f"{head}/config.json") as f:
        before = json.load(f).get("norm_before_residual", False)
    r = o + (_rms(g, t["midlayer.hidden_norm.weight"]) if before else g)
    h = _rms(r, t["midlayer.post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(h @ t["midlayer.mlp.gate_proj.weight"].T)
         * (h @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    p = m + r
    d = int((_rms(p[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
    return p, d + int(t["d2t"][d])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_greedy_identical_and_head_matches_reference(pair, arch):
    target, head_path, layer_ids = pair(arch)
    expected = ids(gen(_llm(target), GREEDY))
    spec = _llm(target, speculative_config=_spec(head_path))
    assert ids(gen(spec, GREEDY)) == expected
    assert ids(gen(spec, GREEDY)) == expected  # again: prefix-cache hits
    drafts, draft_tokens, _ = totals(spec)
    assert drafts > 0 and draft_tokens > drafts  # k > 1 drafts per step
    proposer = spec.llm_engine.executor.worker.runner.proposer
    assert proposer.target.aux_layer_ids == tuple(layer_ids)
    head, calls = proposer.head, []
    forward, choose = head.forward, proposer.choose

    def recording(input_ids, positions, hidden, batch, caches):
        out = forward(input_ids, positions, hidden, batch, caches)
        calls.append((input_ids.clone(), positions.clone(), out.clone()))
        return out

    drafted = []
    head.forward = recording
    proposer.choose = lambda *a: drafted.append(choose(*a)) or drafted[-1]
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 77, 66]  # not cached: one 11-token prefill chunk
    first = ids(gen(spec, SamplingParams(temperature=0, max_tokens=1), [prompt]))[0]
    input_ids, positions, out = calls[0]
    assert positions.tolist() == list(range(len(prompt)))
    assert input_ids.tolist() == prompt[1:] + first
    ref, ref_draft = _reference(target, head_path, layer_ids, prompt, first)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert drafted[0] == [ref_draft]
    # The drafts are target ids from the draft vocabulary (d2t applied).
    assert all(bool(head.d2t.numel()) and 0 <= d < 512 for step in drafted for d in step)


def test_rigged_head_accepts_under_preemption_and_prefix_hits(pair):
    target, head_path, _ = pair("qwen3")
    plain = _llm(target)
    longer = ids(gen(plain, SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K + 1,
                                           ignore_eos=True)))
    expected = [e[:MAX_TOKENS] for e in longer]
    spec = _llm(target, max_model_len=64, speculative_config=_spec(head_path),
                num_gpu_blocks_override=5)
    rig(spec.llm_engine.executor.worker.runner.proposer,
        {tuple(p): e for p, e in zip(PROMPTS, longer)})
    assert ids(gen(spec, GREEDY)) == expected
    drafts, draft_tokens, accepted = totals(spec)
    assert accepted / draft_tokens > 0.95
    assert spec.llm_engine.scheduler.num_preemptions > 0
    per_pos = spec.llm_engine.scheduler.spec_totals.num_accepted_tokens_per_pos
    assert len(per_pos) == K and per_pos[K - 1] > 0
    for _ in range(2):  # the first repeat caches what the preempting batch evicted
        again = gen(spec, GREEDY, PROMPTS[2:3])
        assert ids(again) == expected[2:3]
    assert again[0].num_cached_tokens > 0
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert ids(gen(spec, params)) == [e[:max_tokens] for e in expected]


def test_refusals(pair, tiny_model, tmp_path):
    target, head_path, _ = pair("qwen3")
    wide = make_eagle3_head(target, str(tmp_path / "wide"), hidden_size=96,
                            target_hidden_size=96)
    with pytest.raises(ValueError, match="size 96 but the target's hidden size is 64"):
        _llm(target, speculative_config=_spec(wide))
    vocab = make_eagle3_head(target, str(tmp_path / "vocab"), vocab_size=1024)
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, the target 512"):
        _llm(target, speculative_config=_spec(vocab))
    with pytest.raises(ValueError, match='eagle3 needs "model"'):
        _llm(target, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    fc_norm = make_eagle3_head(target, str(tmp_path / "fcnorm"), norm_before_fc=True)
    with pytest.raises(ValueError, match="'norm_before_fc'"):
        _llm(target, speculative_config=_spec(fc_norm))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        _llm(target, speculative_config=_spec(tiny_model("qwen3")))
