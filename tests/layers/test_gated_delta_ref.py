"""The reference Gated DeltaNet kernels: chunked == recurrent, varlen == per request, chunked
prefill across steps == one pass, conv == F.conv1d, and everything == HF's Qwen3.5 code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from qwenserve.layers.recurrent import (
    TorchRefRecurrentBackend,
    build_gdn_metadata,
    causal_conv1d_varlen,
    gated_delta_net_forward,
    gdn_gating,
    rms_norm_gated,
)
from qwenserve.layers.recurrent.delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

HK, HV, DK, DV, K = 2, 4, 16, 8, 4
ATOL = 2e-5


def make_qkvgb(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HK, DK, generator=gen)  # [T, Hk, Dk]
    k = torch.randn(num_tokens, HK, DK, generator=gen)  # [T, Hk, Dk]
    v = torch.randn(num_tokens, HV, DV, generator=gen)  # [T, Hv, Dv]
    g = -2.0 * torch.rand(num_tokens, HV, generator=gen)  # [T, Hv] log decay <= 0
    beta = torch.rand(num_tokens, HV, generator=gen)  # [T, Hv]
    return q, k, v, g, beta


def random_state(seed: int) -> torch.Tensor:
    return torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(seed))  # [Hv, Dk, Dv]


def cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(length: int, with_state: bool) -> None:
    q, k, v, g, beta = make_qkvgb(length)
    state = random_state(1) if with_state else None
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o_c, o_r, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 37, 130])
def test_matches_hf_torch_kernels(length: int) -> None:
    q, k, v, g, beta = make_qkvgb(length, seed=2)
    state = random_state(3)
    args = (q[None], k[None], v[None], g[None], beta[None])
    kw = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(*args, **kw)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*args, **kw)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o_c, o_hc[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_c, s_hc[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o_r, o_hr[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_r, s_hr[0], atol=1e-6, rtol=1e-6)


def test_varlen_mixed_batch_equals_each_request_alone() -> None:
    lens = [1, 70, 1, 5, 130, 2, 1]
    has_init = [True, False, False, True, True, False, True]
    slots = [6, 0, 3, 2, 5, 7, 1]
    q, k, v, g, beta = make_qkvgb(sum(lens), seed=4)
    pool = torch.randn(9, HV, DK, DV)  # [num_slots, Hv, Dk, Dv]
    pool[[0, 3, 7]] = float("nan")  # fresh requests' slots hold garbage: must not leak in
    before = pool.clone()
    meta = build_gdn_metadata(cu(lens), slots, has_init, chunk_size=32)
    out = gated_delta_net_forward(q, k, v, g, beta, pool, meta)  # [T, Hv, Dv]
    qsl = cu(lens)
    for i, slot in enumerate(slots):
        span = slice(qsl[i], qsl[i + 1])
        init = before[slot] if has_init[i] else None
        o, s = recurrent_gated_delta_rule(q[span], k[span], v[span], g[span], beta[span], init)
        torch.testing.assert_close(out[span], o, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(pool[slot], s, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(pool[[4, 8]], before[[4, 8]])  # unscheduled slots untouched


def conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.conv1d over one whole sequence with K-1 zeros of left padding, then silu."""
    y = F.conv1d(x.T[None], weight[:, None], padding=K - 1, groups=x.shape[1])  # [1, C, T+K-1]
    return F.silu(y[0, :, : x.shape[0]].T)


def test_conv1d_varlen_with_short_continuations() -> None:
    """Two sequences advanced in steps of 3, 1, 2, 6 / 5, 2, 1, 4 tokens (several shorter than
    K-1) beside an unrelated one-shot request, against F.conv1d over each whole sequence."""
    conv_dim = 6
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(conv_dim, K, generator=gen)  # [conv_dim, K]
    seqs = [torch.randn(12, conv_dim, generator=gen) for _ in range(2)]
    other = torch.randn(7, conv_dim, generator=gen)
    state = torch.randn(4, K - 1, conv_dim)  # [num_slots, K-1, conv_dim], garbage at first
    got, done = [[], []], [0, 0]
    for steps in ([3, 5], [1, 2], [2, 1], [6, 4]):
        parts = [s[d : d + n] for s, d, n in zip(seqs, done, steps, strict=True)] + [other]
        x = torch.cat(parts)  # [num_tokens, conv_dim]
        qsl = torch.tensor(cu([p.shape[0] for p in parts]))
        init = torch.tensor([done[0] > 0, done[1] > 0, False])
        y = causal_conv1d_varlen(x, weight, None, state, qsl, torch.tensor([2, 0, 3]), init)
        for i in range(2):
            got[i].append(y[qsl[i] : qsl[i + 1]])
            done[i] += steps[i]
        torch.testing.assert_close(y[qsl[2] :], conv_reference(other, weight))
    for i, slot in enumerate([2, 0]):
        torch.testing.assert_close(torch.cat(got[i]), conv_reference(seqs[i], weight))
        torch.testing.assert_close(state[slot], seqs[i][-(K - 1) :])


def hf_layer(seed: int = 0) -> hf.Qwen3_5GatedDeltaNet:
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=K,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    layer = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # randomise what HF initialises to constants
        layer.norm.weight.normal_(1.0, 0.3)
        layer.dt_bias.normal_(0.0, 0.5)
    return layer


def our_layer(layer: hf.Qwen3_5GatedDeltaNet, x: torch.Tensor, conv_pool, ssm_pool, meta):
    """The Gated DeltaNet layer composed from the reference kernels, as a model file will."""
    num_tokens = x.shape[0]
    mixed = layer.in_proj_qkv(x)  # [T, conv_dim]
    z = layer.in_proj_z(x).view(num_tokens, HV, DV)  # [T, Hv, Dv]
    mixed = causal_conv1d_varlen(
        mixed,
        layer.conv1d.weight,
        None,
        conv_pool,
        meta.query_start_loc,
        meta.state_slots,
        meta.has_initial_state,
    )
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    g, beta = gdn_gating(layer.in_proj_a(x), layer.in_proj_b(x), layer.A_log, layer.dt_bias)
    o = gated_delta_net_forward(
        q.view(num_tokens, HK, DK),
        k.view(num_tokens, HK, DK),
        v.view(num_tokens, HV, DV),
        g,
        beta,
        ssm_pool,
        meta,
    )
    o = rms_norm_gated(o, z, layer.norm.weight, layer.norm.variance_epsilon)
    return layer.out_proj(o.reshape(num_tokens, HV * DV))


def make_pools(num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv_pool = torch.full((num_slots, K - 1, 2 * HK * DK + HV * DV), float("nan"))
    ssm_pool = torch.full((num_slots, HV, DK, DV), float("nan"))  # [num_slots, Hv, Dk, Dv]
    return conv_pool, ssm_pool


@torch.no_grad()
def test_layer_matches_hf_module_across_chunked_prefill_and_decode() -> None:
    """Two sequences advanced by the steps below (prefill chunks, 1-token decodes, mixed in one
    batch; states carried through the pools) == HF's module on each whole sequence."""
    layer = hf_layer()
    seqs = [torch.randn(1, 90, 32), torch.randn(1, 25, 32)]
    want = [layer(s)[0] for s in seqs]  # [T, hidden]
    conv_pool, ssm_pool = make_pools(5)
    steps = [(33, 20), (1, 2), (1, 1), (50, 1), (5, 1)]
    got, done = [[], []], [0, 0]
    for step in steps:
        x = torch.cat([s[0, d : d + n] for s, d, n in zip(seqs, done, step, strict=True)])
        qsl = cu(list(step))
        meta = build_gdn_metadata(qsl, [4, 1], [done[0] > 0, done[1] > 0], chunk_size=16)
        y = our_layer(layer, x, conv_pool, ssm_pool, meta)
        for i in range(2):
            got[i].append(y[qsl[i] : qsl[i + 1]])
            done[i] += step[i]
    for i in range(2):
        torch.testing.assert_close(torch.cat(got[i]), want[i], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_layer_matches_hf_module_in_bf16() -> None:
    layer = hf_layer(seed=1).to(torch.bfloat16)
    x = torch.randn(1, 70, 32, dtype=torch.bfloat16)
    conv_pool, ssm_pool = make_pools(2)
    meta = build_gdn_metadata([0, 70], [1], [False])
    got = our_layer(layer, x[0], conv_pool.bfloat16(), ssm_pool, meta)
    torch.testing.assert_close(got, layer(x)[0], atol=2e-2, rtol=2e-2)


def test_metadata_layout_matches_the_documented_example() -> None:
    """GDNMetadata's docstring example: d0, p1 (5 tokens), d2, p3 (150 tokens), C = 64."""
    lens = [1, 5, 1, 150]
    meta = build_gdn_metadata(cu(lens), [10, 11, 12, 13], [True, False, True, True])
    assert meta.decode_tokens.tolist() == [0, 6] and meta.decode_slots.tolist() == [10, 12]
    assert meta.prefill_slots.tolist() == [13, 11] and meta.active_per_step == (2, 1, 1)
    assert meta.num_chunks == 4
    p3, p1 = meta.prefill_padded_pos[:150].tolist(), meta.prefill_padded_pos[150:].tolist()
    assert p3 == [*range(0, 64), *range(128, 192), *range(192, 214)]  # chunks 0, 2, 3
    assert p1 == list(range(64, 69))  # chunk 1, beside p3's first chunk
    assert meta.chunk_token[64:69].tolist() == list(range(1, 6))
    assert meta.chunk_pad_pos.tolist() == [*range(69, 128), *range(214, 256)]


def test_backend_runs_a_decode_only_step() -> None:
    """Three one-token rows in slots 2, 0, 1; the last is a fresh request (no initial state):
    every row's conv output, conv state, delta-rule output and SSM state is checked."""
    backend = TorchRefRecurrentBackend()
    slots, has_init = [2, 0, 1], [True, True, False]
    meta = backend.build_metadata([0, 1, 2, 3], slots, has_init, "cpu")
    conv_state = torch.randn(3, K - 1, 5)  # [num_slots, K-1, conv_dim]
    conv_before = conv_state.clone()
    x = torch.randn(3, 5)
    weight, bias = torch.randn(5, 1, K), torch.randn(5)
    y = backend.causal_conv1d(x, weight, bias, conv_state, meta)
    assert y.shape == (3, 5)
    for row, (slot, init) in enumerate(zip(slots, has_init, strict=True)):
        hist = conv_before[slot] if init else torch.zeros(K - 1, 5)
        window = torch.cat([hist, x[row : row + 1]])  # [K, conv_dim], oldest first
        want = F.silu((window.T * weight[:, 0]).sum(-1) + bias)
        torch.testing.assert_close(y[row], want)
        torch.testing.assert_close(conv_state[slot], window[1:])
    q, k, v, g, beta = make_qkvgb(3, seed=6)
    pool = torch.randn(3, HV, DK, DV)
    before = pool.clone()
    out = backend.gated_delta_rule(q, k, v, g, beta, pool, meta)
    for row, (slot, init) in enumerate(zip(slots, has_init, strict=True)):
        span = slice(row, row + 1)
        o, s = recurrent_gated_delta_rule(q[span], k[span], v[span], g[span], beta[span],
                                          before[slot] if init else None)
        torch.testing.assert_close(out[span], o)
        torch.testing.assert_close(pool[slot], s)
