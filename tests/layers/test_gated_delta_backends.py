"""Every recurrent (Gated DeltaNet) backend against the token-by-token reference: prefill chunks,
decode steps and the conv, on varlen batches with initial states (prefix-cache restores and
continuations), in fp32 and bf16. ``fused`` runs twice: with its C++ kernels, and with them
off (the fallback a machine without a compiler gets). The C++ chunked prefill also runs at other
chunk sizes, on strided q/k/v views with partial register tiles, and with a bf16 state pool; its
C++ decode reads the layer's strided, unnormalised q/k/v in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenserve.layers.recurrent import RecurrentBackend, get_recurrent_backend
from qwenserve.layers.recurrent import fused as fused_module
from qwenserve.layers.recurrent.delta_rule import recurrent_gated_delta_rule

HK, HV, DK, DV, K = 2, 4, 16, 8, 4
ATOL = 2e-5


@pytest.fixture(params=["torch_ref", "fused", "fused-no-native"])
def backend(request, monkeypatch) -> RecurrentBackend:
    if request.param == "fused-no-native":
        monkeypatch.setattr(fused_module, "native_ops", lambda: None)
        return get_recurrent_backend("fused")
    if request.param == "fused" and fused_module.native_ops() is None:
        pytest.skip("no C++ toolchain here: the fallback case covers this backend")
    return get_recurrent_backend(request.param)


def make_qkvgb(num_tokens: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HK, DK, generator=gen)  # [T, Hk, Dk]
    k = torch.randn(num_tokens, HK, DK, generator=gen)  # [T, Hk, Dk]
    v = torch.randn(num_tokens, HV, DV, generator=gen)  # [T, Hv, Dv]
    g = -2.0 * torch.rand(num_tokens, HV, generator=gen)  # [T, Hv] log decay <= 0
    beta = torch.rand(num_tokens, HV, generator=gen)  # [T, Hv]
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def check_against_recurrence(backend, lens, slots, has_init, dtype=torch.float32, atol=ATOL,
                             seed=0):
    """One varlen step through the backend == each request alone, token by token (fp32)."""
    q, k, v, g, beta = make_qkvgb(sum(lens), seed, dtype)
    pool = torch.randn(max(slots) + 2, HV, DK, DV)  # [num_slots, Hv, Dk, Dv] fp32
    for slot, init in zip(slots, has_init, strict=True):
        if not init:
            pool[slot] = float("nan")  # a fresh request's slot holds garbage: must not leak in
    before = pool.clone()
    meta = backend.build_metadata(cu(lens), slots, has_init, "cpu")
    out = backend.gated_delta_rule(q, k, v, g, beta, pool, meta)  # [T, Hv, Dv]
    assert out.dtype == dtype
    qsl = cu(lens)
    for i, slot in enumerate(slots):
        span = slice(qsl[i], qsl[i + 1])
        init = before[slot] if has_init[i] else None
        o, s = recurrent_gated_delta_rule(q[span], k[span], v[span], g[span], beta[span], init)
        torch.testing.assert_close(out[span].float(), o, atol=atol, rtol=atol)
        torch.testing.assert_close(pool[slot], s, atol=atol, rtol=atol)
    torch.testing.assert_close(pool[-1], before[-1])  # an unscheduled slot is untouched


def test_mixed_varlen_step(backend) -> None:
    check_against_recurrence(backend, [1, 70, 1, 5, 130, 2, 1], [6, 0, 3, 2, 5, 7, 1],
                             [True, False, False, True, True, False, True])


def test_decode_only_batch(backend) -> None:
    """A whole decode batch (the path the C++ kernel takes), some slots fresh."""
    check_against_recurrence(backend, [1] * 9, [8, 3, 0, 5, 1, 7, 2, 6, 4],
                             [True, True, False, True, True, True, False, True, True], seed=1)


def test_prefills_from_restored_states(backend) -> None:
    """Prefill chunks that continue a state (chunked prefill, a prefix-cache restore)."""
    check_against_recurrence(backend, [64, 33, 17, 100], [2, 0, 3, 1], [True, True, True, False],
                             seed=2)


def test_bf16_inputs(backend) -> None:
    """bf16 activations, fp32 state: within bf16's rounding of the fp32 recurrence."""
    check_against_recurrence(backend, [1, 40, 1, 3], [0, 1, 2, 3], [True, False, True, True],
                             dtype=torch.bfloat16, atol=2e-2, seed=3)


def test_chunked_prefill_across_steps_equals_one_pass(backend) -> None:
    """90 tokens as 33 + 1 + 50 + 6 (states carried through the pool) == one 90-token pass."""
    q, k, v, g, beta = make_qkvgb(90, seed=4)
    pool = torch.full((2, HV, DK, DV), float("nan"))
    whole = backend.gated_delta_rule(q, k, v, g, beta, pool.clone()[:1].contiguous(),
                                     backend.build_metadata([0, 90], [0], [False], "cpu"))
    parts, done = [], 0
    for n in (33, 1, 50, 6):
        meta = backend.build_metadata([0, n], [1], [done > 0], "cpu")
        span = slice(done, done + n)
        parts.append(backend.gated_delta_rule(q[span], k[span], v[span], g[span], beta[span],
                                              pool, meta))
        done += n
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=ATOL)


def conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.conv1d over one whole sequence with K-1 zeros of left padding, then silu (fp32)."""
    y = F.conv1d(x.float().T[None], weight.float()[:, None], bias, padding=K - 1,
                 groups=x.shape[1])  # [1, C, T+K-1]
    return F.silu(y[0, :, : x.shape[0]].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_varlen_continuations(backend, dtype, with_bias) -> None:
    """Two sequences advanced in steps of 3, 1, 2, 6 / 5, 2, 1, 4 tokens (several shorter than
    K-1, several single-token decodes) beside a fresh one-shot request, against F.conv1d over
    each whole sequence; 300 channels span more than one of the C++ kernel's channel blocks."""
    conv_dim = 300
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(conv_dim, K, generator=gen).to(dtype)  # [conv_dim, K]
    bias = torch.randn(conv_dim, generator=gen) if with_bias else None
    seqs = [torch.randn(12, conv_dim, generator=gen).to(dtype) for _ in range(2)]
    other = torch.randn(7, conv_dim, generator=gen).to(dtype)
    state = torch.full((4, K - 1, conv_dim), float("nan"), dtype=dtype)  # garbage at first
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    got, done = [[], []], [0, 0]
    for steps in ([3, 5], [1, 2], [2, 1], [6, 4]):
        parts = [s[d : d + n] for s, d, n in zip(seqs, done, steps, strict=True)] + [other]
        x = torch.cat(parts)  # [num_tokens, conv_dim]
        meta = backend.build_metadata(cu([p.shape[0] for p in parts]), [2, 0, 3],
                                      [done[0] > 0, done[1] > 0, False], "cpu")
        y = backend.causal_conv1d(x, weight, bias, state, meta)
        assert y.dtype == dtype
        qsl = cu([p.shape[0] for p in parts])
        for i in range(2):
            got[i].append(y[qsl[i] : qsl[i + 1]])
            done[i] += steps[i]
        torch.testing.assert_close(y[qsl[2] :].float(), conv_reference(other, weight, bias), **tol)
    for i, slot in enumerate([2, 0]):
        torch.testing.assert_close(torch.cat(got[i]).float(), conv_reference(seqs[i], weight, bias),
                                   **tol)
        torch.testing.assert_close(state[slot], seqs[i][-(K - 1) :])  # raw inputs, exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_of_one_token_prompts_reads_zeros_not_the_slots_garbage(backend, dtype) -> None:
    """Single-token requests beside a decode: a fresh one (a one-token prompt) starts from zeros
    whatever its slot holds, a continuing one from its history; both histories shift by a row."""
    conv_dim = 40  # two 16-channel vectors and a tail
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(conv_dim, K, generator=gen).to(dtype)
    history = torch.randn(K - 1, conv_dim, generator=gen).to(dtype)
    x = torch.randn(2, conv_dim, generator=gen).to(dtype)  # [fresh, continuing]
    state = torch.full((3, K - 1, conv_dim), float("nan"), dtype=dtype)
    state[2] = history
    meta = backend.build_metadata([0, 1, 2], [0, 2], [False, True], "cpu")
    y = backend.causal_conv1d(x, weight, None, state, meta)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y[0].float(), conv_reference(x[:1], weight, None)[0], **tol)
    want = conv_reference(torch.cat([history, x[1:]]), weight, None)[-1]
    torch.testing.assert_close(y[1].float(), want, **tol)
    assert torch.equal(state[0], torch.cat([torch.zeros(K - 2, conv_dim, dtype=dtype), x[:1]]))
    assert torch.equal(state[2], torch.cat([history[1:], x[1:]]))


def test_conv_follows_an_in_place_write_of_its_weight() -> None:
    """The C++ conv reads a float32 [K, D] copy of the weight made at first use: a weight
    written in place (a reload, LoRA-style edits) is converted again, not read stale."""
    if fused_module.native_ops() is None:
        pytest.skip("no C++ toolchain here")
    fast = get_recurrent_backend("fused")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 40, generator=gen)
    weight = torch.randn(40, K, generator=gen)
    meta = fast.build_metadata([0, 5], [0], [False], "cpu")
    for _ in range(2):
        y = fast.causal_conv1d(x, weight, None, torch.zeros(1, K - 1, 40), meta)
        torch.testing.assert_close(y, conv_reference(x, weight, None), atol=1e-5, rtol=1e-5)
        weight.mul_(-2.0)


def test_backends_agree_on_a_decode_batch_in_bf16() -> None:
    """The C++ decode step and conv == the reference's on the same bf16 step (fp32 state)."""
    if fused_module.native_ops() is None:
        pytest.skip("no C++ toolchain here")
    ref, fast = get_recurrent_backend("torch_ref"), get_recurrent_backend("fused")
    n, conv_dim = 6, 2 * HK * DK + HV * DV
    meta = ref.build_metadata(list(range(n + 1)), [5, 4, 3, 2, 1, 0], [True] * 5 + [False], "cpu")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, conv_dim, generator=gen).bfloat16()
    weight = torch.randn(conv_dim, K, generator=gen).bfloat16()
    conv = torch.randn(n, K - 1, conv_dim, generator=gen).bfloat16()
    ssm = torch.randn(n, HV, DK, DV, generator=gen)
    conv2, ssm2 = conv.clone(), ssm.clone()
    y_ref, y = ref.causal_conv1d(x, weight, None, conv, meta), fast.causal_conv1d(
        x, weight, None, conv2, meta)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(conv2, conv)
    q, k, v, g, beta = make_qkvgb(n, seed=8, dtype=torch.bfloat16)
    o_ref = ref.gated_delta_rule(q, k, v, g, beta, ssm, meta)
    o = fast.gated_delta_rule(q, k, v, g, beta, ssm2, meta)
    torch.testing.assert_close(o, o_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ssm2, ssm, atol=1e-5, rtol=1e-5)


@pytest.fixture
def reference_calls(monkeypatch) -> list[int]:
    """Counts the fused backend's falls back to the reference's chunked prefill."""
    calls, fallback = [], fused_module._reference_prefill

    def counted(*args, **kwargs):
        calls.append(1)
        return fallback(*args, **kwargs)

    monkeypatch.setattr(fused_module, "_reference_prefill", counted)
    return calls


def native_fused(chunk_size: int) -> RecurrentBackend:
    if fused_module.native_ops() is None:
        pytest.skip("no C++ toolchain here")
    backend = get_recurrent_backend("fused")
    backend.native_chunk_size = chunk_size
    return backend


def test_native_prefill_runs_at_the_builds_chunk_size(monkeypatch) -> None:
    """With no chunk size set, the C++ prefill runs at its build's own: 16 where it was compiled
    for AVX512 (16-lane tiles, -march=native), 32 otherwise."""
    ops = fused_module.native_ops()
    if ops is None:
        pytest.skip("no C++ toolchain here")
    with open("/proc/cpuinfo") as f:
        avx512 = " avx512f " in f.read().replace("\n", " ")
    assert ops.preferred_chunk_size == (16 if avx512 else 32)
    seen = []
    real = type(ops).chunk_prefill
    monkeypatch.setattr(type(ops), "chunk_prefill", lambda self, *a: seen.append(a[-1]) or
                        real(self, *a))
    backend = get_recurrent_backend("fused")
    assert backend.native_chunk_size is None
    check_against_recurrence(backend, [40, 3], [0, 1], [False, False], seed=4)
    assert seen and set(seen) == {ops.preferred_chunk_size}


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_native_prefill_chunk_boundaries(chunk_size, reference_calls) -> None:
    """The C++ prefill at other chunk sizes: prompts of C-1, C, C+1 and 2C+3 tokens (no
    padding: a last chunk has fewer rows) beside decodes, fresh and restored states."""
    c = chunk_size
    check_against_recurrence(native_fused(c), [c - 1, 1, c, c + 1, 1, 2 * c + 3],
                             [0, 1, 2, 3, 4, 5], [False, True, True, False, True, True], seed=9)
    assert not reference_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_strided_views_odd_dims(dtype, reference_calls) -> None:
    """q/k/v as the model passes them (views of the conv output with one row stride), with head
    dims that leave partial register tiles (Dk 40: 6-row blocks + 4 with 8-lane tiles; Dv 24:
    16 + 8 columns, the 8 in an 8-lane tile with 16-lane ones too) and Hv = 3 Hk; against the
    reference backend on the same step, in fp32 and bf16."""
    hk, hv, dk, dv, lens = 1, 3, 40, 24, [37, 1, 5, 70]
    gen = torch.Generator().manual_seed(10)
    mixed = torch.randn(sum(lens), 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(-1, hk, dk), k.view(-1, hk, dk), v.view(-1, hv, dv)  # strided rows
    g = -torch.rand(sum(lens), hv, generator=gen)
    beta = torch.rand(sum(lens), hv, generator=gen).to(dtype)
    pool = torch.randn(6, hv, dk, dv, generator=gen)
    pool_ref = pool.clone()
    slots, init = [4, 0, 2, 5], [True, True, False, True]
    ref = get_recurrent_backend("torch_ref")
    meta = ref.build_metadata(cu(lens), slots, init, "cpu")
    o = native_fused(16).gated_delta_rule(q, k, v, g, beta, pool, meta)
    o_ref = ref.gated_delta_rule(q, k, v, g, beta, pool_ref, meta)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert o.dtype == dtype and not reference_calls
    torch.testing.assert_close(o, o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, pool_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", [24, 144])  # 144: the 16-lane form, a 128-column block and one more
def test_native_decode_reads_the_layer_tensors_in_place(dtype, pool_dtype, dv,
                                                        monkeypatch) -> None:
    """A decode-only step on strided q/k/v views (Hv = 3 Hk, q/k not normalised) goes to the
    kernel that prepares them itself (``decode_rows``), never through prepare_qkv, and equals
    the reference backend's step; with bf16 and f16 state pools (--mamba-ssm-cache-dtype)
    too, the states widened on the read and rounded on the write as the reference does."""
    skip_unless_native_pool(pool_dtype)
    prepared = []
    monkeypatch.setattr(fused_module, "prepare_qkv",
                        lambda *a: prepared.append(1) or pytest.fail("prepare_qkv ran"))
    hk, hv, dk, n = 1, 3, 40, 7
    gen = torch.Generator().manual_seed(12)
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = (t.view(n, h, d) for t, h, d in zip(
        mixed.split([hk * dk, hk * dk, hv * dv], dim=-1), (hk, hk, hv), (dk, dk, dv)))
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    pool = torch.randn(n + 2, hv, dk, dv, generator=gen).to(pool_dtype)
    pool[0] = float("nan")  # slot 0 starts fresh: its garbage must not leak in
    pool_ref = pool.clone()
    slots, init = [3, 0, 8, 5, 1, 7, 2], [True, False, True, True, False, True, True]
    ref = get_recurrent_backend("torch_ref")
    meta = ref.build_metadata(list(range(n + 1)), slots, init, "cpu")
    o = get_recurrent_backend("fused").gated_delta_rule(q, k, v, g, beta, pool, meta)
    o_ref = ref.gated_delta_rule(q, k, v, g, beta, pool_ref, meta)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert o.dtype == dtype and pool.dtype == pool_dtype and not prepared
    torch.testing.assert_close(o, o_ref, atol=tol, rtol=tol)
    # 16-bit states: the same fp32 update rounded once; FMA contraction may move a rounding by
    # an ulp (2^-8 relative in bf16, 2^-11 in f16)
    pool_tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[pool_dtype]
    torch.testing.assert_close(pool.float(), pool_ref.float(), atol=pool_tol, rtol=pool_tol)


def native_and_reference(qkvgb, pool: torch.Tensor, lens: list[int], slots: list[int],
                         init: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step through the C++ prefill (``pool`` updated in place) and through the reference
    on a copy of the pool: (native out, reference out, the reference's pool)."""
    pool_ref = pool.clone()
    ref = get_recurrent_backend("torch_ref")
    meta = ref.build_metadata(cu(lens), slots, init, "cpu")
    o = native_fused(32).gated_delta_rule(*qkvgb, pool, meta)
    return o, ref.gated_delta_rule(*qkvgb, pool_ref, meta), pool_ref


def skip_unless_native_pool(pool_dtype: torch.dtype) -> None:
    ops = fused_module.native_ops()
    if ops is None:
        pytest.skip("no C++ toolchain here")
    if pool_dtype not in ops.pool_codes:
        pytest.skip(f"this build's kernels take no {pool_dtype} state pools (no F16C)")


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_native_prefill_16_bit_state_pool(pool_dtype, reference_calls) -> None:
    """A bf16 or f16 state pool (--mamba-ssm-cache-dtype): read and written back in its dtype,
    as the reference does, by the kernels (a decode in the step too)."""
    skip_unless_native_pool(pool_dtype)
    lens = [40, 1, 19]
    pool = torch.randn(3, HV, DK, DV).to(pool_dtype)
    o, o_ref, pool_ref = native_and_reference(make_qkvgb(sum(lens), seed=11), pool, lens,
                                              [2, 0, 1], [True, True, False])
    assert not reference_calls and pool.dtype == pool_dtype
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.float(), pool_ref.float(), atol=1e-2, rtol=1e-2)


def test_native_kernels_under_subnormal_decays_leave_torch_unflushed(reference_calls) -> None:
    """Strong decays (log gates down to -60 a token) drive the chunk's decay products below
    float's normal range, where the kernels flush subnormals to zero (Intel cores slow down
    ~4x on them otherwise): still the reference's result, and the caller's floating-point mode
    is restored afterwards (torch keeps computing subnormals)."""
    lens = [64, 1, 33]
    q, k, v, g, beta = make_qkvgb(sum(lens), seed=12)
    g = g * 30.0  # log decays in [-60, 0]: exp of their running sums underflows
    pool = torch.randn(3, HV, DK, DV)
    o, o_ref, pool_ref = native_and_reference((q, k, v, g, beta), pool, lens, [0, 1, 2],
                                              [True, True, False])
    assert not reference_calls
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(pool, pool_ref, atol=ATOL, rtol=ATOL)
    tiny = torch.tensor([1e-30], dtype=torch.float32) * torch.tensor([1e-10])
    assert tiny.item() != 0.0  # a subnormal product: not flushed in the caller


def test_unsupported_head_dim_runs_the_reference(reference_calls) -> None:
    """Head dims the C++ prefill does not take (not a multiple of 8) fall back, same results."""
    hk, hv, dk, dv, n = 1, 2, 12, 6, 20
    gen = torch.Generator().manual_seed(12)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v, g = torch.randn(n, hv, dv, generator=gen), -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    pool = torch.zeros(1, hv, dk, dv)
    meta = get_recurrent_backend("torch_ref").build_metadata([0, n], [0], [False], "cpu")
    o = native_fused(32).gated_delta_rule(q, k, v, g, beta, pool, meta)
    assert reference_calls == [1]
    o_ref, state = recurrent_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(pool[0], state, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 20])  # 20: the kernel's tail past whole vectors
def test_gated_rms_norm_matches_the_reference(backend, dtype, head_dim) -> None:
    """The layer's closing norm on the strided gate view the model passes (z, a column block of
    the input projection's output), with gate values past exp's range (SiLU of +-100) and a NaN."""
    from qwenserve.layers.recurrent import rms_norm_gated

    gen = torch.Generator().manual_seed(11)
    tokens, heads = 5, 3
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)  # [T, H, D]
    proj = torch.randn(tokens, heads * head_dim + 7, generator=gen) * 4  # [T, H*D + other]
    proj[0, 2:5] = torch.tensor([100.0, -100.0, 89.0])
    proj[1, 2] = float("nan")  # gate[1, 0, 0]
    gate = proj.to(dtype)[:, 2 : 2 + heads * head_dim].view(tokens, heads, head_dim)
    weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)  # [D]
    if backend.name == "fused" and fused_module.native_ops() is not None:
        assert fused_module.native_ops().supports_gated_norm(x, gate, weight)
    out = backend.gated_rms_norm(x, gate, weight, 1e-6)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, rms_norm_gated(x, gate, weight, 1e-6), equal_nan=True, **tol)
    assert out.shape == x.shape and out.dtype == dtype and out[1, 0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_matches_the_reference(backend, dtype) -> None:
    """g = -exp(A_log) * softplus(a + dt_bias) (past softplus's threshold too) and beta =
    sigmoid(b) with b's rounding, read from strided column blocks of a projection as the model
    passes them; beta comes back in float32 from every backend (the kernels read it so)."""
    from qwenserve.layers.recurrent import gdn_gating

    gen = torch.Generator().manual_seed(5)
    tokens, heads = 37, 6
    proj = (torch.randn(tokens, 3 * heads + 5, generator=gen) * 8).to(dtype)  # [T, ... | b | a]
    proj[0, 5 + heads] = 30.0  # a + dt_bias past softplus's threshold of 20
    b, a = proj[:, 5:5 + heads], proj[:, 5 + heads:5 + 2 * heads]
    A_log, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    if backend.name == "fused" and fused_module.native_ops() is not None:
        assert fused_module.native_ops().supports_gating(a, b, A_log, dt_bias)
    g, beta = backend.gating(a, b, A_log, dt_bias)
    g_ref, beta_ref = gdn_gating(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (tokens, heads)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)
    # rounded as b.sigmoid() rounds (sigmoid itself to ~1 ulp of expf: one bf16 ulp at most)
    assert torch.equal(beta, beta.to(dtype).float())
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(beta, beta_ref.float(), rtol=rtol, atol=0.0)


# ---- state checkpoints (hybrid prefix caching): states saved mid-prefill ---------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_checkpoints_equal_the_states_of_a_prefill_cut_there(backend, dtype) -> None:
    """Prefills asked to save their states after n tokens (n on and off the kernels' chunk
    boundaries, fresh and continuing requests, beside decodes): the slot named gets exactly the
    SSM state of those n tokens and the conv's last K-1 raw rows before them (from the stored
    history where n < K-1), and the outputs and final states are the recurrence's as without."""
    check_state_checkpoints(backend, dtype)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_state_checkpoints_at_every_native_chunk_size(chunk_size) -> None:
    check_state_checkpoints(native_fused(chunk_size), torch.float32)


def check_state_checkpoints(backend: RecurrentBackend, dtype: torch.dtype) -> None:
    lens = [40, 1, 70, 2, 33, 5]
    slots = [1, 2, 3, 4, 5, 6]
    has_init = [False, True, True, False, True, True]
    saves = [(16, 7), None, (37, 8), (1, 9), (32, 10), (2, 11)]  # (n, slot) or None
    q, k, v, g, beta = make_qkvgb(sum(lens), seed=11, dtype=dtype)
    pool = torch.randn(12, HV, DK, DV)
    pool[7:] = float("nan")  # checkpoint slots hold garbage until written
    conv_dim = 24
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(sum(lens), conv_dim, generator=gen).to(dtype)
    weight = torch.randn(conv_dim, K, generator=gen).to(dtype)
    conv = torch.randn(12, K - 1, conv_dim, generator=gen).to(dtype)
    before, conv_before = pool.clone(), conv.clone()
    meta = backend.build_metadata(cu(lens), slots, has_init, "cpu", saves)
    y = backend.causal_conv1d(x, weight, None, conv, meta)
    out = backend.gated_delta_rule(q, k, v, g, beta, pool, meta)
    plain = backend.build_metadata(cu(lens), slots, has_init, "cpu")
    conv_plain, pool_plain = conv_before.clone(), before.clone()
    torch.testing.assert_close(y, backend.causal_conv1d(x, weight, None, conv_plain, plain))
    tol = dict(atol=ATOL, rtol=ATOL) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), backend.gated_delta_rule(
        q, k, v, g, beta, pool_plain, plain).float(), **tol)
    qsl = cu(lens)
    for i, save in enumerate(saves):
        torch.testing.assert_close(pool[slots[i]], pool_plain[slots[i]], atol=ATOL, rtol=ATOL)
        assert torch.equal(conv[slots[i]], conv_plain[slots[i]])
        if save is None:
            continue
        n, slot = save
        span = slice(qsl[i], qsl[i] + n)
        init = before[slots[i]] if has_init[i] else None
        _, state = recurrent_gated_delta_rule(q[span], k[span], v[span], g[span], beta[span],
                                              init)
        torch.testing.assert_close(pool[slot], state, atol=ATOL, rtol=ATOL)
        history = conv_before[slots[i]] if has_init[i] else torch.zeros(K - 1, conv_dim,
                                                                         dtype=dtype)
        assert torch.equal(conv[slot], torch.cat([history, x[span]])[-(K - 1):])


def test_a_state_checkpoint_must_fall_inside_its_request(backend) -> None:
    for bad in [(0, 3), (5, 3), (9, 3)]:
        with pytest.raises(ValueError, match="state checkpoint after"):
            backend.build_metadata([0, 5], [1], [False], "cpu", [bad])
