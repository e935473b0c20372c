"""The CPU paged-attention backend against dense causal attention computed per request.

The cache starts as the worker leaves it (uninitialised, here NaN everywhere but block 0), so a
gather that lets never-written slots into the softmax shows up as NaN."""

from __future__ import annotations

import pytest
import torch

from qwenserve.layers.attention import ChunkLayout, get_attention_backend
from qwenserve.layers.attention.base import kv_slot_ids
from qwenserve.platforms.cpu import _cpu_flags

BLOCK, HQ, HKV, D, NUM_BLOCKS = 4, 6, 2, 8, 32


def dense_reference(q, k_all, v_all, start_pos, scale):
    """q [L, Hq, D] at positions start_pos.., k/v [S, Hkv, D]: causal attention in float64."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all.double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, S, D]
    v = v_all.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, L, S]
    pos = torch.arange(q.shape[0])[:, None] + start_pos
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


# (start_pos, q_len): decodes first (context ends mid-block, on a block edge, one token),
# then a fresh prefill and a chunk after cached tokens.
REQUESTS = [(6, 1), (7, 1), (0, 1), (13, 1), (0, 9), (5, 6)]


@pytest.mark.parametrize("d", [D, 64])  # 64: bf16 prefills take the AMX kernel where it runs
@pytest.mark.parametrize("backend_name", ["torch_ref", "cpu_native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decodes_and_prefills_match_dense_attention(dtype, backend_name, d):
    torch.manual_seed(0)
    cache = torch.full((2, NUM_BLOCKS * BLOCK, HKV, d), float("nan"), dtype=dtype)
    cache[:, :BLOCK].zero_()
    free = torch.randperm(NUM_BLOCKS - 1)[: 40].add(1).tolist()
    chunks, qs, ks, vs, histories, q_start = [], [], [], [], [], 0
    for start, q_len in REQUESTS:
        ctx = start + q_len
        blocks = [free.pop() for _ in range(-(-ctx // BLOCK))]
        k_all, v_all = (torch.randn(ctx, HKV, d).to(dtype) for _ in range(2))
        earlier = torch.tensor(kv_slot_ids(blocks, 0, start, BLOCK), dtype=torch.long)
        cache[0, earlier], cache[1, earlier] = k_all[:start], v_all[:start]  # earlier steps
        chunks.append(ChunkLayout(q_start, q_len, start, blocks))
        qs.append(torch.randn(q_len, HQ, d).to(dtype))
        ks.append(k_all[start:])
        vs.append(v_all[start:])
        histories.append((k_all, v_all))
        q_start += q_len

    backend = get_attention_backend(backend_name)
    meta = backend.build_metadata(chunks, BLOCK, torch.device("cpu"))
    scale = d**-0.5
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, scale)

    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for c, q, (k_all, v_all) in zip(chunks, qs, histories):
        got = out[c.q_start : c.q_start + c.q_len].double()
        torch.testing.assert_close(got, dense_reference(q, k_all, v_all, c.start_pos, scale),
                                   atol=tol, rtol=tol)


@pytest.fixture(params=["default", "16-lane", "generic"])
def decode_kernel(request):
    """Each native decode test with every kernel this CPU runs. default: the AMX kernel for bf16
    (grouped heads, on CPUs with AMX) and the 16-lane one for fp32 (AVX512 CPUs); 16-lane: bf16
    on the vdpbf16ps kernel (AVX512-BF16 CPUs); generic: fp32 on the 8-lane kernel. Where a
    kernel cannot run, its runs take the next one."""
    kernels = _native_backend().kernels if _native_backend() is not None else None
    if kernels is not None:
        available = kernels.use_amx(request.param == "default")
        if request.param == "default":
            assert available or "amx_bf16" not in _cpu_flags() or not native_kernels_have_amx()
        wide = kernels.use_wide_f32(request.param != "generic")
        assert wide or "avx512f" not in _cpu_flags()
    yield request.param
    if kernels is not None:
        kernels.use_amx(True)
        kernels.use_wide_f32(True)


def native_kernels_have_amx() -> bool:
    """Whether this build of the native kernels has AMX code (a compiler that knows the tiles)."""
    from qwenserve.native.gemm import bgemm

    return bgemm() is not None


@pytest.mark.parametrize("d", [64, 128, 256, 72])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_is_built_here_and_matches_torch_ref(d, dtype, decode_kernel):
    """The C++ decode kernel is in use where a compiler is (CI has one), and agrees with the
    reference on a GQA batch with contexts ending mid-block, for the head sizes it unrolls (64,
    128, 256; in bf16 on AVX512-BF16 CPUs the vdpbf16ps kernel) and one it loops over (72);
    QWENSERVE_NATIVE=0 CI runs the fallback through the test above."""
    native = _native_backend()
    if native is None:
        return
    torch.manual_seed(1)
    _check_native_decode(native, d, dtype, hq=14, hkv=2, lens=[1, 17, 100, 250])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_reuses_its_buffers_across_shapes(dtype, decode_kernel):
    """The kernel keeps per-thread scratch (scores, widened rows, sums) between calls: a call
    after a longer context, more query heads per KV head or a larger head still agrees with
    the reference (nothing of the earlier call is read)."""
    native = _native_backend()
    if native is None:
        return
    torch.manual_seed(2)
    for d, hq, hkv, lens in [(128, 16, 2, [250, 240, 230, 220]), (64, 14, 2, [3, 1, 9, 2]),
                             (256, 8, 4, [40, 1, 17, 33]), (64, 2, 2, [250, 5, 1, 64])]:
        _check_native_decode(native, d, dtype, hq, hkv, lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_splits_a_small_batch_over_the_threads(dtype, decode_kernel):
    """With fewer sequences than threads (batch 1 on two cores) each sequence's KV heads are
    split into ranges, one task each: every split (one head a task, uneven ranges, two
    sequences sharing four threads) agrees with the reference."""
    native = _native_backend()
    if native is None:
        return
    torch.manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for d, hq, hkv, lens in [(64, 8, 4, [70]), (128, 6, 3, [33]), (256, 8, 2, [90, 17]),
                                 (64, 8, 4, [5, 40, 18]), (72, 4, 2, [50])]:
            _check_native_decode(native, d, dtype, hq, hkv, lens)
    finally:
        torch.set_num_threads(threads)


# (Hq, Hkv, D): the AMX kernel's shapes: Qwen2.5's 7 heads a KV head, Qwen3's 2 (its fewest),
# 16 (one KV head a 16-row tile), 32 query heads (two ranges of 16), Qwen3.5's heads of 256
AMX_SHAPES = [(14, 2, 64), (4, 2, 128), (16, 1, 64), (32, 4, 128), (8, 2, 256)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("shape", AMX_SHAPES)
def test_native_decode_reads_no_slot_past_the_context(shape, block_size, dtype, decode_kernel):
    """The AMX kernel reads K in place 16 positions at a time, so it reads the slots after a
    context's last position in its block: with every unwritten slot NaN, contexts ending at,
    before and after 16- and 32-position edges (and longer than a 128-slot block) still agree
    with float64 attention (a NaN let into the weights or the sums of V would show). Blocks of
    32 and 128 slots also caught the vdpbf16ps kernel weighting positions 16.. of a block with
    stale weights (fixed 2026-12-06)."""
    native = _native_backend()
    if native is None:
        return
    hq, hkv, d = shape
    torch.manual_seed(4)
    lens = [1, 15, 16, 17, 31, 32, 33, 64, 200]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = torch.full((2, num_blocks * block_size, hkv, d), float("nan"), dtype=dtype)
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    chunks, qs, ks, vs, histories = [], [], [], [], []
    for i, n in enumerate(lens):
        blocks = [order.pop() for _ in range(-(-n // block_size))]
        k_all, v_all = (torch.randn(n, hkv, d).to(dtype) for _ in range(2))
        earlier = torch.tensor(kv_slot_ids(blocks, 0, n - 1, block_size), dtype=torch.long)
        cache[0, earlier], cache[1, earlier] = k_all[:-1], v_all[:-1]
        chunks.append(ChunkLayout(i, 1, n - 1, blocks))
        qs.append(torch.randn(1, hq, d).to(dtype))
        ks.append(k_all[-1:])
        vs.append(v_all[-1:])
        histories.append((k_all, v_all))
    meta = native.build_metadata(chunks, block_size, torch.device("cpu"))
    out = native.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, d**-0.5)
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for c, q, (k_all, v_all) in zip(chunks, qs, histories):
        torch.testing.assert_close(out[c.q_start].double(),
                                   dense_reference(q, k_all, v_all, c.start_pos, d**-0.5)[0],
                                   atol=tol, rtol=tol)


def test_amx_decode_is_the_same_for_every_block_size():
    """The AMX kernel walks a context 16 positions at a time whatever the block size, so the
    same K, V and q laid out in blocks of 16, 32 or 128 slots (shuffled over the pool) give
    bit-identical outputs (an engine's greedy tokens do not depend on --block-size). Skipped
    where the kernel cannot run."""
    native = _native_backend()
    if native is None or not native.kernels.use_amx(True):
        pytest.skip("no AMX decode kernel here")
    torch.manual_seed(5)
    hq, hkv, d, lens = 14, 2, 64, [1, 16, 33, 200, 129]
    ks = [torch.randn(n, hkv, d).bfloat16() for n in lens]
    vs = [torch.randn(n, hkv, d).bfloat16() for n in lens]
    q = torch.randn(len(lens), hq, d).bfloat16()
    outs = []
    for bs in (16, 32, 128):
        num_blocks = sum(-(-n // bs) for n in lens) + 1
        cache = torch.zeros(2, num_blocks * bs, hkv, d, dtype=torch.bfloat16)
        order = (torch.randperm(num_blocks - 1) + 1).tolist()
        tables = []
        for n, k, v in zip(lens, ks, vs):
            blocks = [order.pop() for _ in range(-(-n // bs))]
            slots = torch.tensor(kv_slot_ids(blocks, 0, n, bs), dtype=torch.long)
            cache[0, slots], cache[1, slots] = k, v
            tables.append(blocks + [0] * (16 - len(blocks)))
        outs.append(native.kernels(q, cache, torch.tensor(tables), torch.tensor(lens), bs,
                                   d**-0.5))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _native_backend():
    """The cpu_native backend with its kernel, or None where none is built (then asserted)."""
    from qwenserve.native import build, native_enabled

    native = get_attention_backend("cpu_native")
    if not native_enabled() or build.compiler() is None:
        assert native.kernels is None
        return None
    assert native.kernels is not None
    return native


def _check_native_decode(native, d: int, dtype: torch.dtype, hq: int, hkv: int,
                         lens: list[int]) -> None:
    bs = 16
    cache = torch.randn(2, 64 * bs, hkv, d).to(dtype)
    tables = [torch.randperm(64)[: -(-n // bs)].tolist() for n in lens]
    chunks = [ChunkLayout(i, 1, n - 1, t) for i, (n, t) in enumerate(zip(lens, tables))]
    n = len(lens)
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)  # views of one projection, as in a model
    q, k, v = (t.view(n, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    ref = get_attention_backend("torch_ref")
    caches = [cache.clone(), cache.clone()]
    outs = [b.forward(q, k, v, c, b.build_metadata(chunks, bs, torch.device("cpu")), d**-0.5)
            for b, c in zip((ref, native), caches)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    # the decode-only step's K/V went into the cache inside the kernel, exactly where
    # index_copy_ puts them (the tables share blocks, so every write precedes every read)
    assert torch.equal(caches[1], caches[0])


# (L, S, Hq, Hkv, D): a fresh prompt, tails of 16-row query blocks and 32-token key tiles, a
# chunk after cached tokens, one query row, grouped and plain heads, every head size the kernel
# takes (D % 32 == 0; 96 has an output group of two 16-dim tiles)
PREFILLS = [(256, 256, 14, 2, 64), (37, 37, 14, 2, 64), (20, 100, 8, 2, 256), (1, 5, 4, 4, 128),
            (300, 333, 16, 8, 128), (17, 17, 2, 1, 32), (50, 83, 6, 2, 96)]


@pytest.fixture(params=["amx", "dot"])
def prefill_route(request):
    """The prefill kernel's products on AMX tiles or as vdpbf16ps dot products (the route of
    AVX512-BF16 CPUs without AMX), where this machine runs each."""
    kernel = get_attention_backend("cpu_native").prefill_kernel
    if kernel is None:
        yield None  # no kernel here: the test checks that and the fallback
        return
    if not kernel.use_amx(True) and request.param == "amx":
        pytest.skip("no AMX tiles for this process")
    kernel.use_amx(request.param == "amx")
    yield request.param
    kernel.use_amx(True)


@pytest.mark.parametrize("shape", PREFILLS)
def test_native_prefill_matches_torch_ref(shape, prefill_route):
    """The prefill kernel builds wherever a compiler is (a failed build would only log a
    warning), is in use where the CPU has AVX512-BF16 (not on an AVX2-only CI machine), and
    agrees with PyTorch's flash kernel within bf16 rounding on either route: scores and softmax
    in fp32, P rounded to bf16 for the product, as flash kernels do."""
    from qwenserve.layers.attention.torch_ref import _prefill
    from qwenserve.native import build, native_enabled
    from qwenserve.native.attention import prefill_attention_library

    native = get_attention_backend("cpu_native")
    if native_enabled() and build.compiler() is not None:
        lib = prefill_attention_library()
        assert lib is not None
        # an AVX512-BF16 CPU runs it unless the compiler lacks the instructions
        runs = bool(lib.prefill_attention_available())
    else:
        runs = False
    assert (native.prefill_kernel is not None) == runs
    if prefill_route == "dot" and not runs:
        pytest.skip("no prefill kernel here (the AMX case covered the fallback)")
    length, ctx, hq, hkv, d = shape
    torch.manual_seed(3)
    q = torch.randn(length, hq, d).bfloat16()
    k, v = (torch.randn(ctx, hkv, d).bfloat16() for _ in range(2))
    ref = _prefill(q, k, v, d**-0.5)
    out = native.prefill(q, k, v, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    exact = dense_reference(q, k, v, ctx - length, d**-0.5)
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=2e-2)


def test_native_prefill_leaves_other_inputs_to_torch_ref():
    """fp32, or a head size that is not a multiple of 32: PyTorch's flash kernel, bit for bit."""
    from qwenserve.layers.attention.torch_ref import _prefill

    native = get_attention_backend("cpu_native")
    torch.manual_seed(4)
    for dtype, d in [(torch.float32, 64), (torch.bfloat16, 72)]:
        q = torch.randn(40, 4, d).to(dtype)
        k, v = (torch.randn(60, 2, d).to(dtype) for _ in range(2))
        assert torch.equal(native.prefill(q, k, v, 0.1), _prefill(q, k, v, 0.1))



def test_native_prefill_propagates_a_nan_as_torch_ref_does(prefill_route):
    """A NaN in one key makes exactly the rows that see it NaN (the kernel's fast exp does not
    clamp it away)."""
    from qwenserve.layers.attention.torch_ref import _prefill

    native = get_attention_backend("cpu_native")
    torch.manual_seed(5)
    q = torch.randn(20, 4, 64).bfloat16()
    k, v = (torch.randn(20, 2, 64).bfloat16() for _ in range(2))
    k[5, 0, 3] = float("nan")
    got, ref = native.prefill(q, k, v, 0.125), _prefill(q, k, v, 0.125)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.isnan(got[5:, :2]).all() and not torch.isnan(got[:5]).any()
