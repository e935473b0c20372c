"""The fused elementwise kernels (native/csrc/elementwise.cpp) against the layers' PyTorch
reference: RMSNorm with and without the residual add (plain and zero-centred), SiLU-and-mul,
the sigmoid output gate, rotary and per-token int8 quantization (and the W8A8 MLP's fused
middle against those kernels in turn), in fp32 and bf16, at odd sizes and on strided views as
the model hands them over."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from qwenserve.layers.activation import sigmoid_gate, silu_and_mul
from qwenserve.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from qwenserve.layers.rotary import RotaryEmbedding
from qwenserve.native.elementwise import elementwise
from qwenserve.quantization.kernels import Int8Matmul, quantize_per_token

KERNELS = elementwise()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler: nothing native to test")
DTYPES = [torch.float32, torch.bfloat16]


def _norms(cls, hidden: int, dtype: torch.dtype, seed: int) -> tuple[RMSNorm, RMSNorm]:
    """The same norm twice: the reference (no kernels) and the fused one."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + (0 if cls.zero_centred else 1)).to(dtype)
    ref, fused = cls(hidden, 1e-6, dtype), cls(hidden, 1e-6, dtype, KERNELS)
    ref.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    return ref, fused


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal up to the RMS's summation order; bf16: at most one bf16 ulp apart."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.bfloat16:
        ulp = want.float().abs().clamp_min(1e-30) * 2.0**-7
        assert ((got.float() - want.float()).abs() <= ulp).all()
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, ZeroCenteredRMSNorm])
@pytest.mark.parametrize("rows,hidden", [(1, 7), (5, 37), (64, 896), (300, 129)])
def test_add_rms_norm_matches_the_reference(dtype, cls, rows, hidden):
    ref, fused = _norms(cls, hidden, dtype, seed=rows + hidden)
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    want, want_res = ref(x, residual)
    got, got_res = fused(x, residual)
    assert torch.equal(got_res, want_res)  # the add is one rounding either way
    _assert_close(got, want)
    _assert_close(fused(x), ref(x))
    assert torch.equal(x, (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(
        hidden)) * 3).to(dtype)), "the inputs were written to"


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_reads_strided_views_in_place(dtype):
    """Qwen3's q/k norm: [T, H, D] views of the fused qkv output (token stride > H * D)."""
    tokens, heads, head_dim, width = 9, 3, 40, 3 * 40 + 56
    ref, fused = _norms(RMSNorm, head_dim, dtype, seed=1)
    qkv = torch.randn(tokens, width, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert not q.is_contiguous()
    _assert_close(fused(q), ref(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 3), (7, 45), (64, 4864 // 8), (33, 1000)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inter, silu_route):
    gen = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    x[0, 0], x[-1, 1 % inter] = -100.0, 95.0  # exp's clamps: silu -> -0 and -> x
    _assert_close(silu_and_mul(x, KERNELS), silu_and_mul(x.clone()))
    strided = torch.randn(rows, 2 * inter + 5, generator=gen).to(dtype)[:, 3 : 3 + 2 * inter]
    _assert_close(silu_and_mul(strided, KERNELS), silu_and_mul(strided.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 5), (3, 2, 16), (64, 8, 256)])
def test_sigmoid_gate_reads_the_strided_gate_in_place(dtype, tokens, heads, head_dim):
    """Qwen3.5's gated attention: q and its gate interleave per head in one projection, so the
    gate arrives as a strided view; out = x * sigmoid(gate) with the reference's roundings
    (sigmoid to ~1 ulp of expf: at most one bf16 ulp apart), gates past exp's range and NaN."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    qg = torch.randn(tokens, heads, 2 * head_dim, generator=gen) * 4  # [T, H, q | gate]
    qg[0, 0, head_dim:head_dim + 3] = torch.tensor([100.0, -100.0, float("nan")])[:head_dim]
    qg = qg.to(dtype)
    gate = qg[..., head_dim:]
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    want = sigmoid_gate(x, gate)
    got = sigmoid_gate(x, gate, KERNELS)
    assert got.shape == (tokens, heads * head_dim) and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    _assert_close(got.masked_fill(nan, 0), want.masked_fill(nan, 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 3), (7, 45), (64, 608), (33, 1000)])
def test_silu_mul_quantize_is_the_three_kernels_in_turn(dtype, rows, inter):
    """The W8A8 MLP's middle in one pass gives the very integers and scales of scale_rows,
    silu_and_mul and quantize_per_token run one after the other (what the plain path does)."""
    gen = torch.Generator().manual_seed(rows + inter)
    acc = torch.randn(rows, 2 * inter, generator=gen) * 300
    acc[0, 0], acc[-1, inter] = -3e4, 2e4  # a gate past exp's range, a large up
    acc[rows // 2] = 0.0  # a row of zeros: the scale's floor
    row_scale = torch.rand(rows, 1, generator=gen) * 0.05
    y = KERNELS.silu_and_mul(KERNELS.scale_rows(acc.clone(), row_scale, dtype))
    want_q, want_scale = KERNELS.quantize_per_token(y)
    got_q, got_scale = KERNELS.silu_mul_quantize(acc, row_scale, dtype)
    assert got_q.dtype == torch.int8 and got_q.shape == (rows, inter)
    assert torch.equal(got_q, want_q) and torch.equal(got_scale, want_scale)


def test_silu_propagates_nan_and_inf():
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), 1.0, 2.0, 3.0]])
    got, want = silu_and_mul(x, KERNELS), silu_and_mul(x.clone())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.fixture(params=["table", "computed"])
def silu_route(request):
    """bf16 SiLU looked up (Intel's default) or computed (elsewhere), whichever this CPU is."""
    previous = KERNELS.use_silu_table(request.param == "table")
    if previous is None and request.param == "table":
        pytest.skip("this build has no SiLU table (no AVX512-BF16)")
    yield request.param
    if previous is not None:
        KERNELS.use_silu_table(previous)


def test_bf16_silu_is_the_computed_one_for_every_bf16_value(silu_route):
    """bf16 SiLU-and-mul looks silu(gate) up in a table of every bf16 value or computes it (where
    the build has AVX512-BF16; the CPU's vendor picks): with up = 1 either must give, for all
    65,536 bit patterns, the float32 kernel's computed silu rounded to bf16, bit for bit (NaN as
    NaN; results below float32's normal range are zero, as AVX512-BF16's rounding makes them),
    and stay within a bf16 ulp of torch's."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate.reshape(-1, 64)
    ones = torch.ones_like(gate)
    got = KERNELS.silu_and_mul(torch.cat([gate, ones], 1))
    computed = KERNELS.silu_and_mul(torch.cat([gate, ones], 1).float())
    want = computed.bfloat16()
    nan, tiny = want.isnan(), computed.abs() < torch.finfo(torch.float32).tiny
    assert torch.equal(got.isnan(), nan)
    assert (got[tiny] == 0).all()
    normal = ~nan & ~tiny
    assert torch.equal(got.view(torch.int16)[normal], want.view(torch.int16)[normal])
    torch_silu = torch.nn.functional.silu(gate.float()).bfloat16()
    finite = torch_silu.isfinite() & (torch_silu.float().abs() > 1e-37)
    _assert_close(got[finite], torch_silu[finite])


def _rope_config(partial: float) -> tf.Qwen3Config:
    return tf.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=48, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1e6,
                                                        "partial_rotary_factor": partial})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [48, 12])  # full, and Qwen3.5's quarter
def test_rotary_in_place_equals_the_reference_bit_for_bit(dtype, rotary_dim):
    """On q/k views of a fused qkv output, as the attention layer hands them over."""
    config = _rope_config(rotary_dim / 48)
    ref = RotaryEmbedding(config, 48, rotary_dim, 512)
    fused = RotaryEmbedding(config, 48, rotary_dim, 512, KERNELS)
    tokens = 37
    qkv = torch.randn(tokens, (4 + 2 + 2) * 48, generator=torch.Generator().manual_seed(3))
    qkv = (qkv * 2).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(4))
    q, k = qkv[:, : 4 * 48].view(tokens, 4, 48), qkv[:, 4 * 48 : 6 * 48].view(tokens, 2, 48)
    want_q, want_k = ref(positions, q.clone(), k.clone())
    got_q, got_k = fused(positions, q, k)
    assert got_q.data_ptr() == qkv.data_ptr(), "rotated in place"
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", [(1, 896), (64, 4864), (7, 33), (3, 1)])
def test_int8_quantize_gives_the_reference_integers_and_scales(dtype, rows, k):
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 5).to(dtype)
    x[-1] = 0  # an all-zero row: the scale floor, not a division by zero
    if k >= 5:  # absmax 127 makes the scale exactly 1: x.5 values are ties (half to even)
        x[0, :5] = torch.tensor([127.0, 2.5, -2.5, 0.5, -1.5]).to(dtype)
    got, want = KERNELS.quantize_per_token(x), quantize_per_token(x)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    if k >= 5:
        assert got[0][0, 1:5].tolist() == [2, -2, 0, -2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 896), (64, 9728), (5, 3)])
def test_scale_rows_is_the_reference_multiply_and_cast(dtype, rows, n):
    acc, row_scale = torch.randn(rows, n) * 1e3, torch.rand(rows, 1)
    want = (acc * row_scale).to(dtype)
    got = KERNELS.scale_rows(acc.clone(), row_scale, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_int8_quantize_reads_row_strided_views_and_the_matmul_uses_it():
    wide = torch.randn(4, 100).bfloat16()
    view = wide[:, 10:74]  # rows 100 apart, as a slice of a fused projection's output
    got, want = KERNELS.quantize_per_token(view), quantize_per_token(view)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    matmul = Int8Matmul(None, quantizer=KERNELS)
    calls = []
    quantize = KERNELS.quantize_per_token

    class Counting:
        supports = KERNELS.supports

        def quantize_per_token(self, x):
            calls.append(x.shape)
            return quantize(x)

    matmul.quantizer = Counting()
    assert torch.equal(matmul.quantize(view)[0], want[0]) and calls == [(4, 64)]
    assert torch.equal(matmul.quantize(view.half())[0], quantize_per_token(view.half())[0])
    assert calls == [(4, 64)]  # fp16 is not the kernel's: the reference ran


def test_rotary_refuses_positions_beyond_the_table():
    fused = RotaryEmbedding(_rope_config(1.0), 48, 48, 16, KERNELS)
    q, k = torch.randn(2, 4, 48), torch.randn(2, 2, 48)
    with pytest.raises(IndexError, match="outside the table of 16"):
        fused(torch.tensor([3, 16]), q, k)


def test_unsupported_inputs_run_the_reference():
    """fp16 and non-unit inner strides: the layers fall back to the PyTorch code."""
    ref, fused = _norms(RMSNorm, 16, torch.float16, seed=5)
    x = torch.randn(4, 16).half()
    assert torch.equal(fused(x), ref(x))
    x32 = torch.randn(16, 4).t()  # last dim strided
    ref32, fused32 = _norms(RMSNorm, 16, torch.float32, seed=5)
    assert not KERNELS.supports(x32)
    assert torch.equal(fused32(x32), ref32(x32))
