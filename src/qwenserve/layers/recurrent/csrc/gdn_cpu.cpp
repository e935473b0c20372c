// Gated DeltaNet CPU kernels that PyTorch cannot express without extra passes over memory.
// Plain C++ with extern "C" entry points, loaded with ctypes (qwenserve.native.load_library).
//
// gdn_decode_f32 / gdn_decode_rows: one token per sequence, the state updated in place in its
//   pool slot (the _rows form also prepares q, k, v from the layer's tensors, and takes bf16
//   and f16 pools: --mamba-ssm-cache-dtype). The PyTorch form gathers each state out of the
//   pool, reads it twice and scatters it back (about five passes over 1 MiB per sequence and
//   layer); here each (sequence, head) state is read once for both products and rewritten once
//   while it is still in L2.
// gdn_conv_{f32,bf16}: the depthwise causal conv over a varlen batch, history read from and
//   written back to the conv-state pool, without building the padded copy of the inputs.
// gdn_chunk_{f32,bf16}: the chunked prefill (below, at chunk_task).
// gdn_gated_norm_{f32,bf16}: the gated RMSNorm that ends the layer, one pass instead of the
//   reference's eight ops (and no copy of the strided gate rows).
// gdn_gating_{f32,bf16}: the decay g and the write strength beta from the a/b projections.
// Maths and layouts as the reference (layers/recurrent/torch_ref.py, delta_rule.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// exp16, silu16, FlushSubnormals (qwenserve/native/csrc, on the include path)
#include "vec_math.h"

namespace {

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float round(float x) { return x; }  // the value a T tensor holds for x
};

struct BF16 {  // bfloat16 as its bits; round to nearest even on the way out, as torch does
  using T = uint16_t;
  static float load(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  static float round(float x) { return load(store(x)); }
};

#if defined(__F16C__)
#define QS_GDN_F16 1
// IEEE half as its bits, a type of its own so that the 16-lane loads and stores overload on it.
struct Half {
  uint16_t bits;
};
// float16 state pools (--mamba-ssm-cache-dtype float16) with F16C's conversions: round to
// nearest even, inf past the range, as torch's .to(torch.float16).
struct F16 {
  using T = Half;
  static float load(Half x) { return _cvtsh_ss(x.bits); }
  static Half store(float f) { return Half{_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)}; }
};
#endif

// 8 floats (GCC/Clang vector extensions: one AVX2 register here, two NEON ones on Arm).
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }
inline vec8 splat8(float x) { return vec8{x, x, x, x, x, x, x, x}; }

typedef int32_t ivec8 __attribute__((vector_size(32)));

inline float sum8(vec8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// e^x for 8 floats at once: Cephes' expf (range reduction by ln 2 in two parts, a degree-6
// polynomial), within 2 ulp of expf over [-87.3, 88.37]. Below, x is clamped to -87.3 (e^x stays
// a normal float; the callers only add 1 to it); above 88.37 the result is +inf (as expf's from
// 88.73). A NaN x gives +inf: callers keep NaN by dividing x by it. The scalar loop's std::exp
// does not vectorise here (errno), and SiLU's exp was most of the conv's time.
inline vec8 exp8(vec8 x) {
  x = x < splat8(89.0f) ? x : splat8(89.0f);  // n = 128 there: the 2^n below is +inf
  x = x > splat8(-87.3f) ? x : splat8(-87.3f);
  const vec8 magic = splat8(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec8 n = (x * splat8(1.44269504088896341f) + magic) - magic;
  const vec8 r = (x - n * splat8(0.693359375f)) + n * splat8(2.12194440e-4f);
  vec8 p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  p = p * (r * r) + r + splat8(1.0f);
  const ivec8 bits = (__builtin_convertvector(n, ivec8) + 127) << 23;  // 2^n
  vec8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x[0..n) = silu(x) = x / (1 + e^-x) in place, 8 at a time (the tail with std::exp).
inline void silu_inplace(float* x, int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const vec8 a = load8(x + c);
    store8(x + c, a / (splat8(1.0f) + exp8(-a)));
  }
  for (; c < n; ++c) x[c] = x[c] / (1.0f + std::exp(-x[c]));
}

#if defined(__AVX512F__)
// The value a T tensor holds for each of 16 floats (F32: itself; BF16: BF16::round's bits).
inline __m512 round16(__m512 v, F32) { return v; }
inline __m512 round16(__m512 v, BF16) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                               _mm512_set1_epi32(int32_t(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}

// 16 channels of one T row as f32 / back (masked: the tail of a block). The bf16 store rounds
// as BF16::store; with AVX512-BF16 it is vec_math.h's one-instruction conversion instead.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return load_bf16(p, m); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
#if defined(QS_GDN_F16)
inline __m512 load16(const Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline void store16(Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  store_bf16(p, to_bf16(v), m);
#else
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16(v, BF16{})), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits));
#endif
}

// The K = 4 conv of one request's n tokens over nc channels, 32 channels (two vectors) at a
// time: each pass keeps its four taps' weights and the last three inputs in registers, reads
// every input row once and writes every output row once (the generic loop below re-reads each
// row per tap and goes through an accumulator array: 13 ms a layer for 2,048 tokens x 6,144
// channels). past: the K-1 history rows in f32 (stride ldp), oldest first. The sums are the
// generic loop's (bias first, then tap by tap, fused multiply-adds as -ffp-contract=fast makes
// of it); SiLU is vec_math.h's silu16, within an ulp of the generic loop's.
template <typename DT>
void conv4_block(typename DT::T* out, const typename DT::T* x, int64_t x_stride, int64_t ldo,
                 const float* weight_t, int64_t ldw, const float* bias, const float* past,
                 int64_t ldp, int64_t n, int64_t nc, int silu) {
  constexpr int64_t kAhead = 32;  // rows prefetched ahead
  for (int64_t c = 0; c < nc; c += 32) {
    __mmask16 m[2];
    __m512 w[4][2], win[3][2], b[2];
    for (int v = 0; v < 2; ++v) {
      const int64_t left = nc - c - 16 * v;
      m[v] = tail_mask(left);
      const int64_t cv = c + 16 * v;
      for (int j = 0; j < 4; ++j) w[j][v] = load16(weight_t + j * ldw + cv, m[v]);
      for (int j = 0; j < 3; ++j) win[j][v] = load16(past + j * ldp + cv, m[v]);
      b[v] = bias ? load16(bias + cv, m[v]) : _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < n; ++t) {
      const typename DT::T* row = x + t * x_stride + c;
      typename DT::T* yr = out + t * ldo + c;
      if (t + kAhead < n) {  // rows lie a row stride apart: no hardware prefetcher follows that
        __builtin_prefetch(row + kAhead * x_stride, 0, 3);
        __builtin_prefetch(yr + kAhead * ldo, 1, 3);
      }
      for (int v = 0; v < 2; ++v) {
        const __m512 xt = load16(row + 16 * v, m[v]);
        __m512 a = _mm512_fmadd_ps(w[0][v], win[0][v], b[v]);
        a = _mm512_fmadd_ps(w[1][v], win[1][v], a);
        a = _mm512_fmadd_ps(w[2][v], win[2][v], a);
        a = _mm512_fmadd_ps(w[3][v], xt, a);
        win[0][v] = win[1][v], win[1][v] = win[2][v], win[2][v] = xt;
        if (silu) a = silu16(a);
        store16(yr + 16 * v, a, m[v]);
      }
    }
  }
}

// A decode's K = 4 conv (one token) over nc channels: the three history rows read from the
// state as they lie (no f32 copy of the window), then shifted by one row in place. The sums are
// conv4_block's, in its order; the history is stored back as the raw values it holds (exact).
// The windowed path cost a 64-sequence Qwen3.5-0.8B decode step 5.4 ms over 18 layers.
template <typename DT>
void conv4_decode(typename DT::T* out, const typename DT::T* x, const float* weight_t,
                  int64_t ldw, const float* bias, typename DT::T* st, int64_t D, int64_t nc,
                  bool has_init, int silu) {
  for (int64_t c = 0; c < nc; c += 16) {
    const __mmask16 m = tail_mask(nc - c);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0;
    if (has_init) {
      s0 = load16(st + c, m);
      s1 = load16(st + D + c, m);
      s2 = load16(st + 2 * D + c, m);
    }
    const __m512 xt = load16(x + c, m);
    __m512 a = _mm512_fmadd_ps(load16(weight_t + c, m), s0,
                               bias ? load16(bias + c, m) : _mm512_setzero_ps());
    a = _mm512_fmadd_ps(load16(weight_t + ldw + c, m), s1, a);
    a = _mm512_fmadd_ps(load16(weight_t + 2 * ldw + c, m), s2, a);
    a = _mm512_fmadd_ps(load16(weight_t + 3 * ldw + c, m), xt, a);
    if (silu) a = silu16(a);
    store16(out + c, a, m);
    store16(st + c, s1, m);
    store16(st + D + c, s2, m);
    store16(st + 2 * D + c, xt, m);
  }
}
#endif

// x [T, D] rows of stride x_stride; weight_t [K, D] f32; bias [D] f32 or null;
// state [S, K-1, D]; qsl [R+1], slots [R]; has_init [R] (bytes); out [T, D] contiguous.
// One task per (request, block of channels). Token t's window is the rows t-K+1 .. t of the
// request's sequence prefixed by its K-1 history rows: the first K-1 tokens read some of the
// history (a copy in f32), the rest read x where it lies. No shifting copy per token.
template <typename DT>
void conv(typename DT::T* out, const typename DT::T* x, int64_t x_stride, const float* weight_t,
          const float* bias, typename DT::T* state, const int64_t* qsl, const int64_t* slots,
          const uint8_t* has_init, int64_t R, int64_t D, int64_t K, int silu) {
  using T = typename DT::T;
  const int64_t hist = K - 1;
  // Channels per task: 256 gives one long request enough tasks; a decode-only batch (one token
  // per request) takes 2,048, since 64 decodes x 6,144 channels in blocks of 256 made 1,536
  // tasks of ~1 us each, and their scheduling cost more than the work (0.6 ms a layer).
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) longest = std::max(longest, qsl[r + 1] - qsl[r]);
  const int64_t kBlock = longest > 1 ? 256 : 2048;
  const int64_t blocks = (D + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<float> past(hist * kBlock), acc(kBlock);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < R * blocks; ++task) {
      const int64_t r = task / blocks, c0 = (task % blocks) * kBlock;
      const int64_t nc = std::min(kBlock, D - c0), first = qsl[r], n = qsl[r + 1] - qsl[r];
      int64_t n_done = 0;  // tokens computed by the register-window path
      T* st = state + slots[r] * hist * D + c0;
#if defined(__AVX512F__)
      if (K == 4 && n == 1) {
        conv4_decode<DT>(out + first * D + c0, x + first * x_stride + c0, weight_t + c0, D,
                         bias ? bias + c0 : nullptr, st, D, nc, has_init[r] != 0, silu);
        continue;
      }
#endif
      for (int64_t j = 0; j < hist; ++j) {  // the history, oldest row first
        float* pj = past.data() + j * kBlock;
        if (has_init[r]) {
          for (int64_t c = 0; c < nc; ++c) pj[c] = DT::load(st[j * D + c]);
        } else {
          std::fill(pj, pj + nc, 0.0f);
        }
      }
      float* a = acc.data();
#if defined(__AVX512F__)
      if (K == 4) {  // Qwen3.5's and Qwen3-Next's kernel: the window in registers
        conv4_block<DT>(out + first * D + c0, x + first * x_stride + c0, x_stride, D,
                        weight_t + c0, D, bias ? bias + c0 : nullptr, past.data(), kBlock, n,
                        nc, silu);
        n_done = n;
      }
#endif
      for (int64_t t = n_done; t < n; ++t) {
        for (int64_t c = 0; c < nc; ++c) a[c] = bias ? bias[c0 + c] : 0.0f;
        for (int64_t j = 0; j < K; ++j) {  // window row j is sequence row t - hist + j
          const float* w = weight_t + j * D + c0;
          const int64_t s = t - hist + j;
          if (s < 0) {
            const float* row = past.data() + (hist + s) * kBlock;
            for (int64_t c = 0; c < nc; ++c) a[c] += w[c] * row[c];
          } else {
            const T* row = x + (first + s) * x_stride + c0;
            for (int64_t c = 0; c < nc; ++c) a[c] += w[c] * DT::load(row[c]);
          }
        }
        if (silu) silu_inplace(a, nc);
        T* yr = out + (first + t) * D + c0;
        for (int64_t c = 0; c < nc; ++c) yr[c] = DT::store(a[c]);
      }
      // the new state: the last K-1 raw inputs (history rows too when n < K-1), exactly
      for (int64_t j = 0; j < hist; ++j) {
        const int64_t s = n - hist + j;
        if (s < 0) {
          for (int64_t c = 0; c < nc; ++c) st[j * D + c] = DT::store(past[(hist + s) * kBlock + c]);
        } else {
          const T* row = x + (first + s) * x_stride + c0;
          std::copy(row, row + nc, st + j * D);
        }
      }
    }
  }
}

// ---- gated RMSNorm ---------------------------------------------------------------------------
#if defined(__AVX512F__)
// One row in 16 lanes: the sum of squares, then T(T(w * T(x_hat)) * silu16(gate)) (the generic
// loop below widens the row into buffers and rounds lane by lane: 3 ms a call for 2,048 tokens
// x 16 heads of 128).
template <typename DT>
void gated_norm_row16(typename DT::T* o, const typename DT::T* xr, const typename DT::T* gr,
                      const typename DT::T* w, int64_t h, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t c = 0; c < h; c += 16) {
    const __mmask16 m = tail_mask(h - c);
    const __m512 v = load16(xr + c, m);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 inv = _mm512_set1_ps(
      1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(h) + eps));
  for (int64_t c = 0; c < h; c += 16) {
    const __mmask16 m = tail_mask(h - c);
    const __m512 xn = round16(_mm512_mul_ps(load16(xr + c, m), inv), DT{});
    const __m512 y = round16(_mm512_mul_ps(load16(w + c, m), xn), DT{});
    store16(o + c, _mm512_mul_ps(y, silu16(load16(gr + c, m))), m);
  }
}
#endif

// out = T(T(w * T(x_hat)) * silu(gate)) per row of h (HF's Qwen3_5RMSNormGated, roundings as
// gated_norm.py's reference: the normalised row and its product with w are T tensors, the gate
// is applied in f32). Row (i, j) of x starts at x + i * x_so + j * x_si, of gate likewise (the
// gate z is a strided view of the input projection); out is contiguous [n_outer * n_inner, h].
template <typename DT>
void gated_rms_norm(typename DT::T* out, const typename DT::T* x, const typename DT::T* gate,
                    const typename DT::T* w, int64_t n_outer, int64_t n_inner, int64_t x_so,
                    int64_t x_si, int64_t g_so, int64_t g_si, int64_t h, float eps) {
  const int64_t rows = n_outer * n_inner;
#pragma omp parallel if (rows * h >= (int64_t{1} << 17))
  {
#if !defined(__AVX512F__)
    std::vector<float> bx(h), bg(h);
#endif
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / n_inner, j = r % n_inner;
      const typename DT::T *xr = x + i * x_so + j * x_si, *gr = gate + i * g_so + j * g_si;
#if defined(__AVX512F__)
      gated_norm_row16<DT>(out + r * h, xr, gr, w, h, eps);
#else
      float ss = 0.0f;
      for (int64_t c = 0; c < h; ++c) {
        bx[c] = DT::load(xr[c]);
        bg[c] = DT::load(gr[c]);
      }
      int64_t c8 = 0;  // 8 partial sums: a scalar chain does not vectorise without fast-math
      vec8 sq = splat8(0.0f);
      for (; c8 + 8 <= h; c8 += 8) sq += load8(bx.data() + c8) * load8(bx.data() + c8);
      ss = sum8(sq);
      for (; c8 < h; ++c8) ss += bx[c8] * bx[c8];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
      for (int64_t c = 0; c < h; ++c) bx[c] = DT::round(DT::load(w[c]) * DT::round(bx[c] * inv));
      silu_inplace(bg.data(), h);
      typename DT::T* o = out + r * h;
      for (int64_t c = 0; c < h; ++c) o[c] = DT::store(bx[c] * bg[c]);
#endif
    }
  }
}

// ---- chunked prefill -------------------------------------------------------------------------
// The chunked form of the gated delta rule (delta_rule.py's chunk_terms + chunk_scan), one task
// per (prefill, value head), its chunks in order. Every product goes through one register-blocked
// tile (`tile`); a task's working set (the 128 x 128 state, the chunk's q/k/v and its C x C
// terms: ~200 KB at C = 32) stays in L2, and the state panel a column block of the scan works on
// (Dk x 16 floats) in L1. No padding: the last chunk of a prefill has n <= C rows.

// A vector of W floats (GCC/Clang vector extensions): 8 is one AVX2 register (two NEON ones),
// 16 one AVX512 register. Scalars broadcast in arithmetic with them.
// (A trait, not an alias template: GCC drops vector_size from a dependent alias template.)
template <int W>
struct VecOf;
template <>
struct VecOf<8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecOf<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <int W>
using vecf = typename VecOf<W>::type;

template <typename V>
inline V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// C[MR x W*NV] = alpha * Cin + A[MR x kk] . B[kk x W*NV] (row-major; Cin null: from zero). The
// MR x NV accumulators stay in registers over the kk loop (AVX2: 6 x 2 of its 16; AVX512: 8 x 2
// of its 32, twice the lanes: the chunked prefill's products ran at AVX2's FMA peak).
template <int W, int MR, int NV>
inline void tile(int64_t kk, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, const float* Cin, int64_t ldcin, float alpha) {
  using V = vecf<W>;
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = Cin ? alpha * loadv<V>(Cin + r * ldcin + W * v) : V{};
  for (int64_t k = 0; k < kk; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = loadv<V>(B + k * ldb + W * v);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(C + r * ldc + W * v, &acc[r][v], sizeof(V));
}

// The state's columns the scan carries at a time (chunk_scan): two 16-lane vectors with AVX512,
// so that its products run on tile<16, 8, 2> (16 accumulators: 10 loads to 16 FMAs; one
// vector's tile<16, 8, 1> issued 9 loads to 8 FMAs and bound the prefill on its loads; the
// 128 x 32 panel of the state, 16 KB, still stays in L1); 16 columns with 8-lane vectors.
#if defined(__AVX512F__)
constexpr int64_t kPanel = 32;
#else
constexpr int64_t kPanel = 16;
#endif

// C[m x n] = alpha * Cin + A[m x k] . B[k x n] for n a multiple of 8 (Cin may be C itself).
// lower: A is lower triangular, so the rows i0.. of a block read only k < i0 + rows.
// skip_upper: the blocks of C wholly above the diagonal (column > row) are not computed.
struct Gemm {
  const float* A;
  int64_t lda;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  const float* Cin = nullptr;
  int64_t ldcin = 0;
  float alpha = 1.0f;
  bool lower = false, skip_upper = false;
};

// Columns j.. j + W*NV of C, in row blocks of up to MR rows.
template <int W, int MR, int NV>
void gemm_columns(const Gemm& g, int64_t m, int64_t k, int64_t j) {
  for (int64_t i = 0; i < m; i += MR) {
    const int64_t mr = std::min<int64_t>(MR, m - i);
    if (g.skip_upper && j >= i + mr) continue;
    const int64_t kk = g.lower ? std::min(k, i + mr) : k;
    const float* A = g.A + i * g.lda;
    float* C = g.C + i * g.ldc + j;
    const float* Cin = g.Cin ? g.Cin + i * g.ldcin + j : nullptr;
#define QS_TILE(R) tile<W, R, NV>(kk, A, g.lda, g.B + j, g.ldb, C, g.ldc, Cin, g.ldcin, g.alpha)
    switch (mr) {
      case 8: if constexpr (MR >= 8) { QS_TILE(8); break; } [[fallthrough]];
      case 7: if constexpr (MR >= 7) { QS_TILE(7); break; } [[fallthrough]];
      case 6: QS_TILE(6); break;
      case 5: QS_TILE(5); break;
      case 4: QS_TILE(4); break;
      case 3: QS_TILE(3); break;
      case 2: QS_TILE(2); break;
      default: QS_TILE(1); break;
    }
#undef QS_TILE
  }
}

void gemm(const Gemm& g, int64_t m, int64_t n, int64_t k) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 32 <= n; j += 32) gemm_columns<16, 8, 2>(g, m, k, j);
  for (; j + 16 <= n; j += 16) gemm_columns<16, 8, 1>(g, m, k, j);
#else
  for (; j + 16 <= n; j += 16) gemm_columns<8, 6, 2>(g, m, k, j);
#endif
  if (j < n) gemm_columns<8, 6, 1>(g, m, k, j);  // n % 16 == 8
}

// One call: the prefills of a varlen step (sorted longest first, so that dynamic scheduling
// starts the long tasks first). q, k [T, Hk, Dk] and v [T, Hv, Dv]: rows of the given strides,
// heads contiguous; g, beta [T, Hv] contiguous f32; pool [S, Hv, Dk, Dv]; out [T, Hv, Dv].
// checkpoint_lens[r] > 0: prefill r's state after that many tokens is also stored in pool slot
// checkpoint_slots[r] (hybrid prefix caching; its chunk there is cut short).
struct ChunkArgs {
  const void *q, *k, *v;
  int64_t q_stride, k_stride, v_stride;
  const float *g, *beta;
  void* pool;
  void* out;
  const int64_t *starts, *lens, *slots;
  const uint8_t* has_init;
  const int64_t *checkpoint_lens, *checkpoint_slots;
  int64_t num_prefills, Hk, Hv, Dk, Dv, C;
};

// A task's buffers (floats), one set per thread, kept from call to call (`workspace`).
struct Workspace {
  std::vector<float> mem;
  int64_t shape[3] = {0, 0, 0};
  float *S, *K, *KT, *V, *X, *U, *O, *A, *T, *Tb, *Tw, *Att, *P, *Vn, *gam, *bet, *eg;
  void resize(int64_t C, int64_t Dk, int64_t Dv) {
    if (shape[0] == C && shape[1] == Dk && shape[2] == Dv) return;
    shape[0] = C, shape[1] = Dk, shape[2] = Dv;
    const int64_t sizes[] = {Dk * Dv, C * Dk, Dk * C, C * Dv, 2 * C * Dk, C * Dv, C * Dv,
                             C * C,   C * C,  C * C,  C * C,  C * C,      2 * C * kPanel,
                             C * kPanel,
                             C,       C,      C};
    float** ptrs[] = {&S, &K, &KT, &V, &X, &U, &O, &A, &T, &Tb, &Tw, &Att, &P, &Vn, &gam, &bet,
                      &eg};
    int64_t total = 16;  // room to start at a cache line; the sizes keep 32-byte alignment
    for (int64_t n : sizes) total += n;
    mem.assign(total, 0.0f);
    float* p = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64 / 4;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
      *ptrs[i] = p;
      p += sizes[i];
    }
  }
};

// dst[0..n) = row[0..n) in f32 (a plain loop: the compiler vectorises the conversion).
template <typename DT>
inline void load_row(const typename DT::T* row, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = DT::load(row[d]);
}

// x[0..n) *= scale / sqrt(sum(x^2) + 1e-6): FLA's l2norm (eps inside the root), n % 8 == 0.
inline void l2_normalise(float* x, int64_t n, float scale) {
  vec8 sq = splat8(0.0f);
  for (int64_t d = 0; d < n; d += 8) sq += load8(x + d) * load8(x + d);
  const vec8 s = splat8(scale / std::sqrt(sum8(sq) + 1e-6f));
  for (int64_t d = 0; d < n; d += 8) store8(x + d, load8(x + d) * s);
}

// Load the chunk's n <= C rows: q, k l2-normalised in f32 (q also scaled by Dk^-1/2), K and its
// transpose KT, Q into X's rows n..2n-1 (below W, so that [W; Q] S is one product), V, the
// in-chunk cumulative log decay gam and beta.
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
}

// Rows are strided (the conv output's): row t of the next chunk is prefetched while row t of
// this one is packed, so that its loads do not wait on memory.
template <typename DT>
void pack_chunk(const ChunkArgs& a, Workspace& w, int64_t t0, int64_t n, int64_t end,
                int64_t h) {
  const int64_t Dk = a.Dk, Dv = a.Dv, C = a.C, kh = h / (a.Hv / a.Hk);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  float* Q = w.X + n * Dk;
  const auto* q = static_cast<const typename DT::T*>(a.q) + t0 * a.q_stride + kh * Dk;
  const auto* k = static_cast<const typename DT::T*>(a.k) + t0 * a.k_stride + kh * Dk;
  const auto* v = static_cast<const typename DT::T*>(a.v) + t0 * a.v_stride + h * Dv;
  float gsum = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    float* qt = Q + t * Dk;
    float* kt = w.K + t * Dk;
    load_row<DT>(q + t * a.q_stride, qt, Dk);
    load_row<DT>(k + t * a.k_stride, kt, Dk);
    load_row<DT>(v + t * a.v_stride, w.V + t * Dv, Dv);
    if (t0 + t + C < end) {
      prefetch_row(q + (t + C) * a.q_stride, Dk);
      prefetch_row(k + (t + C) * a.k_stride, Dk);
      prefetch_row(v + (t + C) * a.v_stride, Dv);
    }
    l2_normalise(qt, Dk, q_scale);
    l2_normalise(kt, Dk, 1.0f);
    gsum += a.g[(t0 + t) * a.Hv + h];
    w.gam[t] = gsum;
    w.bet[t] = a.beta[(t0 + t) * a.Hv + h];
    w.eg[t] = std::exp(gsum);
  }
  for (int64_t t = n; t < C; ++t) w.bet[t] = w.eg[t] = 0.0f;
  for (int64_t d = 0; d < Dk; ++d)  // contiguous stores; the strided loads hit L1
    for (int64_t t = 0; t < n; ++t) w.KT[d * C + t] = w.K[t * Dk + d];
}

// The chunk's own terms, with Γ_ij = exp(gam_i - gam_j):
//   A = strict_lower(beta_i k_i.k_j Γ_ij),  T = (I + A)^-1 (forward substitution),
//   U = T diag(beta) V,  W = T diag(beta exp(gam)) K  (into X's rows 0..n-1),
//   Att = lower(q_i.k_j Γ_ij),  then Q *= exp(gam) and KT *= exp(gam_n - gam) in place.
void chunk_terms(Workspace& w, int64_t n, int64_t C, int64_t Dk, int64_t Dv) {
  float* Q = w.X + n * Dk;
  gemm({w.K, Dk, w.KT, C, w.A, C, nullptr, 0, 1.0f, false, true}, n, C, Dk);
  gemm({Q, Dk, w.KT, C, w.Att, C, nullptr, 0, 1.0f, false, true}, n, C, Dk);
  for (int64_t i = 0; i < n; ++i) {
    float* a = w.A + i * C;
    float* att = w.Att + i * C;
    for (int64_t j = 0; j < i; ++j) {
      const float decay = std::exp(w.gam[i] - w.gam[j]);
      a[j] *= w.bet[i] * decay;
      att[j] *= decay;
    }
    std::fill(a + i, a + C, 0.0f);
    std::fill(att + i + 1, att + C, 0.0f);
  }
  const int64_t nv = C / 8;
  for (int64_t i = 0; i < n; ++i) {  // row i of T: e_i - sum_{j<i} A_ij T_j
    float* ti = w.T + i * C;
    std::fill(ti, ti + C, 0.0f);
    for (int64_t j = 0; j < i; ++j) {
      const vec8 s = splat8(w.A[i * C + j]);
      const float* tj = w.T + j * C;
      for (int64_t v = 0; v < nv; ++v) store8(ti + 8 * v, load8(ti + 8 * v) - s * load8(tj + 8 * v));
    }
    ti[i] = 1.0f;
    for (int64_t c = 0; c < C; ++c) {
      w.Tb[i * C + c] = ti[c] * w.bet[c];
      w.Tw[i * C + c] = ti[c] * w.bet[c] * w.eg[c];
    }
  }
  Gemm u{w.Tb, C, w.V, Dv, w.U, Dv};
  u.lower = true;
  gemm(u, n, Dv, n);
  Gemm wk{w.Tw, C, w.K, Dk, w.X, Dk};
  wk.lower = true;
  gemm(wk, n, Dk, n);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < Dk; ++d) Q[t * Dk + d] *= w.eg[t];
  const float last = w.gam[n - 1];
  for (int64_t t = 0; t < n; ++t) {
    const float kd = std::exp(last - w.gam[t]);
    for (int64_t d = 0; d < Dk; ++d) w.KT[d * C + t] *= kd;
  }
}

// Carry the state across the chunk, one column block of S (and of V, U, O) at a time: the
// columns of the delta rule are independent, so a block's state panel stays in L1 for
//   P = [W; Q] S,  Vn = U - P_w,  O = P_q + Att Vn,  S = exp(gam_n) S + KT Vn.
void chunk_scan(Workspace& w, int64_t n, int64_t C, int64_t Dk, int64_t Dv) {
  const float decay = std::exp(w.gam[n - 1]);
  constexpr int64_t PW = kPanel;
  for (int64_t j = 0; j < Dv; j += PW) {
    const int64_t width = std::min<int64_t>(PW, Dv - j);
    gemm({w.X, Dk, w.S + j, Dv, w.P, PW}, 2 * n, width, Dk);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < width; ++c) w.Vn[i * PW + c] = w.U[i * Dv + j + c] - w.P[i * PW + c];
    Gemm o{w.Att, C, w.Vn, PW, w.O + j, Dv, w.P + n * PW, PW};
    o.lower = true;
    gemm(o, n, width, n);
    gemm({w.KT, C, w.Vn, PW, w.S + j, Dv, w.S + j, Dv, decay}, Dk, width, n);
  }
}

template <typename PT>
inline typename PT::T* state_of(const ChunkArgs& a, int64_t slot, int64_t h) {
  return static_cast<typename PT::T*>(a.pool) + (slot * a.Hv + h) * a.Dk * a.Dv;
}

template <typename DT, typename PT>
void chunk_task(const ChunkArgs& a, Workspace& w, int64_t r, int64_t h) {
  const int64_t Dk = a.Dk, Dv = a.Dv, C = a.C, len = a.lens[r];
  const int64_t checkpoint = a.checkpoint_lens[r];  // 0: none
  typename PT::T* slot = state_of<PT>(a, a.slots[r], h);
  for (int64_t i = 0; i < Dk * Dv; ++i) w.S[i] = a.has_init[r] ? PT::load(slot[i]) : 0.0f;
  auto* out = static_cast<typename DT::T*>(a.out);
  for (int64_t c0 = 0; c0 < len;) {
    const int64_t n = std::min(C, (c0 < checkpoint ? checkpoint : len) - c0);
    const int64_t t0 = a.starts[r] + c0;
    pack_chunk<DT>(a, w, t0, n, a.starts[r] + len, h);
    chunk_terms(w, n, C, Dk, Dv);
    chunk_scan(w, n, C, Dk, Dv);
    for (int64_t t = 0; t < n; ++t) {
      typename DT::T* row = out + ((t0 + t) * a.Hv + h) * Dv;
      for (int64_t d = 0; d < Dv; ++d) row[d] = DT::store(w.O[t * Dv + d]);
    }
    c0 += n;
    if (c0 == checkpoint) {
      typename PT::T* saved = state_of<PT>(a, a.checkpoint_slots[r], h);
      for (int64_t i = 0; i < Dk * Dv; ++i) saved[i] = PT::store(w.S[i]);
    }
  }
  for (int64_t i = 0; i < Dk * Dv; ++i) slot[i] = PT::store(w.S[i]);
}

// This thread's workspace: fresh pages would cost a page fault each, on every call.
Workspace& workspace(int64_t C, int64_t Dk, int64_t Dv) {
  static thread_local Workspace w;
  w.resize(C, Dk, Dv);
  return w;
}

template <typename DT, typename PT>
void chunk_prefill(const ChunkArgs& a) {
#pragma omp parallel
  {
    const FlushSubnormals ftz;
    Workspace& w = workspace(a.C, a.Dk, a.Dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < a.num_prefills * a.Hv; ++task)
      chunk_task<DT, PT>(a, w, task / a.Hv, task % a.Hv);
  }
}

// One (sequence, value head) decode step on its state S [Dk, Dv] in place, stored as PT (f32,
// or bf16 / f16 with --mamba-ssm-cache-dtype: widened on the read, the new state rounded on
// the write, as the reference's pool[slots].float() ... index_copy_(.to(bf16)); half the bytes
// of the step's memory-bound pass): q, k (normalised, q scaled), v rows in f32; o [Dv] f32.
// kv, qs, delta: [Dv] scratch.
template <typename PT>
inline void decode_head(typename PT::T* S, const float* qr, const float* kr, const float* vr,
                        float decay, float bt, bool init, float* o, float* kv, float* qs,
                        float* delta, int64_t Dk, int64_t Dv) {
  if (!init) std::fill(S, S + Dk * Dv, typename PT::T{});  // a fresh slot may hold NaN
  std::fill(kv, kv + Dv, 0.0f);
  std::fill(qs, qs + Dv, 0.0f);
  float kq = 0.0f;
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = kr[i], qi = qr[i];
    const typename PT::T* row = S + i * Dv;
    kq += ki * qi;
    for (int64_t j = 0; j < Dv; ++j) {
      const float s = PT::load(row[j]);
      kv[j] += ki * s;
      qs[j] += qi * s;
    }
  }
  for (int64_t j = 0; j < Dv; ++j) {
    const float d = bt * (vr[j] - decay * kv[j]);
    delta[j] = d;
    o[j] = decay * qs[j] + kq * d;
  }
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = kr[i];
    typename PT::T* row = S + i * Dv;
    for (int64_t j = 0; j < Dv; ++j) row[j] = PT::store(decay * PT::load(row[j]) + ki * delta[j]);
  }
}

#if defined(__AVX512F__)
// decode_head in 16 lanes (Dv % 16 == 0): the products' sums for up to 128 state columns stay
// in registers over the Dk rows, and bf16 states widen and round with single instructions (the
// scalar loops above, with BF16's conversions, ran a bf16 pool at 17 GB/s against f32's 31:
// slower than the f32 pool it halves).
template <typename PT>
inline void decode_head16(typename PT::T* S, const float* qr, const float* kr, const float* vr,
                          float decay, float bt, bool init, float* o, float* delta, int64_t Dk,
                          int64_t Dv) {
  constexpr int64_t NV = 8;  // 16 accumulators of 32: room for the broadcasts and loads
  if (!init) std::fill(S, S + Dk * Dv, typename PT::T{});
  float kq = 0.0f;
  for (int64_t i = 0; i < Dk; ++i) kq += kr[i] * qr[i];
  const __m512 dec = _mm512_set1_ps(decay), b = _mm512_set1_ps(bt), kqv = _mm512_set1_ps(kq);
  for (int64_t j0 = 0; j0 < Dv; j0 += 16 * NV) {
    const int64_t nv = std::min<int64_t>(NV, (Dv - j0) / 16);
    __m512 kv[NV], qs[NV];
    for (int64_t c = 0; c < NV; ++c) kv[c] = qs[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < Dk; ++i) {
      const __m512 ki = _mm512_set1_ps(kr[i]), qi = _mm512_set1_ps(qr[i]);
      const typename PT::T* row = S + i * Dv + j0;
      for (int64_t c = 0; c < NV; ++c)
        if (c < nv) {
          const __m512 sv = load16(row + 16 * c, 0xffff);
          kv[c] = _mm512_fmadd_ps(ki, sv, kv[c]);
          qs[c] = _mm512_fmadd_ps(qi, sv, qs[c]);
        }
    }
    for (int64_t c = 0; c < nv; ++c) {
      const int64_t j = j0 + 16 * c;
      const __m512 d = _mm512_mul_ps(b, _mm512_fnmadd_ps(dec, kv[c], _mm512_loadu_ps(vr + j)));
      _mm512_storeu_ps(delta + j, d);
      _mm512_storeu_ps(o + j, _mm512_fmadd_ps(dec, qs[c], _mm512_mul_ps(kqv, d)));
    }
  }
  for (int64_t i = 0; i < Dk; ++i) {
    const __m512 ki = _mm512_set1_ps(kr[i]);
    typename PT::T* row = S + i * Dv;
    for (int64_t j = 0; j < Dv; j += 16)
      store16(row + j, _mm512_fmadd_ps(dec, load16(row + j, 0xffff),
                                       _mm512_mul_ps(ki, _mm512_loadu_ps(delta + j))), 0xffff);
  }
}
#endif

// The decodes of a step straight from the layer's tensors: q, k [T, Hk, Dk] and v [T, Hv, Dv]
// as the conv left them (rows of any stride, heads contiguous; q/k not yet normalised), g, beta
// [T, Hv] f32; token rows[i] of request i, its state in slot slots[i]. q and k are l2-normalised
// here (q also scaled by Dk^-1/2) and value head h reads key head h / (Hv / Hk), as
// prepare_qkv does; out [T, Hv, Dv] (contiguous, T) gets the decodes' rows. The Python form of
// the same preparation took ~25 small torch ops a layer.
template <typename DT, typename PT>
void decode_rows(typename DT::T* out, typename PT::T* pool, const typename DT::T* q,
                 const typename DT::T* k, const typename DT::T* v, int64_t q_stride,
                 int64_t k_stride, int64_t v_stride, const float* g, const float* beta,
                 const int64_t* rows, const int64_t* slots, const uint8_t* has_init, int64_t n,
                 int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  const int64_t group = Hv / Hk;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
#pragma omp parallel
  {
    const FlushSubnormals ftz;
    std::vector<float> qf(Dk), kf(Dk), vf(Dv), of(Dv), kv(Dv), qs(Dv), delta(Dv);
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < n * Hv; ++idx) {
      const int64_t i = idx / Hv, h = idx % Hv, t = rows[i], kh = h / group;
      load_row<DT>(q + t * q_stride + kh * Dk, qf.data(), Dk);
      load_row<DT>(k + t * k_stride + kh * Dk, kf.data(), Dk);
      load_row<DT>(v + t * v_stride + h * Dv, vf.data(), Dv);
      l2_normalise(qf.data(), Dk, q_scale);
      l2_normalise(kf.data(), Dk, 1.0f);
      typename PT::T* S = pool + (slots[i] * Hv + h) * Dk * Dv;
      const float decay = std::exp(g[t * Hv + h]), bt = beta[t * Hv + h];
#if defined(__AVX512F__)
      if (Dv % 16 == 0)
        decode_head16<PT>(S, qf.data(), kf.data(), vf.data(), decay, bt, has_init[i] != 0,
                          of.data(), delta.data(), Dk, Dv);
      else
#endif
        decode_head<PT>(S, qf.data(), kf.data(), vf.data(), decay, bt, has_init[i] != 0,
                        of.data(), kv.data(), qs.data(), delta.data(), Dk, Dv);
      typename DT::T* o = out + (t * Hv + h) * Dv;
      for (int64_t j = 0; j < Dv; ++j) o[j] = DT::store(of[j]);
    }
  }
}

// fn(D{}, P{}) for the layer tensors' dtype code dt (0 f32, 1 bf16) and the state pool's pt
// (0 f32, 1 bf16, 2 f16 where the build has F16C); 1 (fn not called) for another pair.
template <typename Fn>
int with_types(int dt, int pt, Fn fn) {
  auto pool = [&](auto d) {
    if (pt == 0) {
      fn(d, F32{});
    } else if (pt == 1) {
      fn(d, BF16{});
#if defined(QS_GDN_F16)
    } else if (pt == 2) {
      fn(d, F16{});
#endif
    } else {
      return 1;
    }
    return 0;
  };
  if (dt == 0) return pool(F32{});
  if (dt == 1) return pool(BF16{});
  return 1;
}

// ---- gating ----------------------------------------------------------------------------------
// g = -exp(A_log) * softplus(a + dt_bias) in f32 (torch's softplus: past 20 it is x itself) and
// beta = sigmoid(b) rounded to the layer's dtype as b.sigmoid() is, kept in f32 (the kernels
// read both so). a, b: rows of H values at their own strides (columns of the in_proj output).
// Its reference is torch_ref.gdn_gating: five PyTorch ops a layer, the one thing in a decode
// step's Gated DeltaNet layer that was not a native kernel.
template <typename DT>
void gating(float* g, float* beta, const typename DT::T* a, const typename DT::T* b,
            int64_t a_stride, int64_t b_stride, const float* A_log, const float* dt_bias,
            int64_t T, int64_t H) {
#pragma omp parallel for schedule(static) if (T * H >= 16384)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float x = DT::load(a[t * a_stride + h]) + dt_bias[h];
      const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
      g[t * H + h] = -std::exp(A_log[h]) * softplus;
      const float y = DT::load(b[t * b_stride + h]);
      beta[t * H + h] = DT::round(1.0f / (1.0f + std::exp(-y)));
    }
  }
}

}  // namespace

extern "C" {

// The chunk size this build's prefill runs fastest at: 16 where the product tile has 16 lanes
// (2,048-token Qwen3.5-0.8B step on the AMX Xeon: 1.79-1.83 vs 1.85-1.91 s at 32), 32 with
// 8-lane tiles (measured best on the AVX2 EPYC).
int64_t gdn_chunk_size() {
#if defined(__AVX512F__)
  return 16;
#else
  return 32;
#endif
}

// q, k [B, H, Dk] (l2-normalised, q scaled, heads repeated), v [B, H, Dv], g, beta [B, H]:
// contiguous f32. pool [S, H, Dk, Dv] f32; slots [B]; has_init [B] (bytes). out [B, H, Dv].
void gdn_decode_f32(float* out, float* pool, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, const int64_t* slots,
                    const uint8_t* has_init, int64_t B, int64_t H, int64_t Dk, int64_t Dv) {
#pragma omp parallel
  {
    const FlushSubnormals ftz;
    std::vector<float> kv(Dv), qs(Dv), delta(Dv);
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < B * H; ++idx) {
      const int64_t b = idx / H, h = idx % H;
      decode_head<F32>(pool + (slots[b] * H + h) * Dk * Dv, q + idx * Dk, k + idx * Dk,
                       v + idx * Dv, std::exp(g[idx]), beta[idx], has_init[b] != 0,
                       out + idx * Dv, kv.data(), qs.data(), delta.data(), Dk, Dv);
    }
  }
}

// decode_rows above; dt: the layer tensors' dtype (0 f32, 1 bf16), pt: the state pool's (0 f32,
// 1 bf16, 2 f16 where gdn_has_f16_pool).
// Returns 1 (nothing done) for another code.
int gdn_decode_rows(void* out, void* pool, const void* q, const void* k, const void* v,
                    int64_t q_stride, int64_t k_stride, int64_t v_stride, const float* g,
                    const float* beta, const int64_t* rows, const int64_t* slots,
                    const uint8_t* has_init, int64_t n, int64_t Hk, int64_t Hv, int64_t Dk,
                    int64_t Dv, int dt, int pt) {
  return with_types(dt, pt, [&](auto d, auto p) {
    using D = decltype(d);
    using P = decltype(p);
    decode_rows<D, P>(static_cast<typename D::T*>(out), static_cast<typename P::T*>(pool),
                      static_cast<const typename D::T*>(q), static_cast<const typename D::T*>(k),
                      static_cast<const typename D::T*>(v), q_stride, k_stride, v_stride, g,
                      beta, rows, slots, has_init, n, Hk, Hv, Dk, Dv);
  });
}

// Whether this build takes float16 state pools (pool code 2): it needs F16C's conversions.
int gdn_has_f16_pool() {
#if defined(QS_GDN_F16)
  return 1;
#else
  return 0;
#endif
}

void gdn_conv_f32(float* out, const float* x, int64_t x_stride, const float* weight_t,
                  const float* bias, float* state, const int64_t* qsl, const int64_t* slots,
                  const uint8_t* has_init, int64_t R, int64_t D, int64_t K, int silu) {
  conv<F32>(out, x, x_stride, weight_t, bias, state, qsl, slots, has_init, R, D, K, silu);
}

void gdn_gated_norm_f32(float* out, const float* x, const float* gate, const float* w,
                        int64_t n_outer, int64_t n_inner, int64_t x_so, int64_t x_si,
                        int64_t g_so, int64_t g_si, int64_t h, float eps) {
  gated_rms_norm<F32>(out, x, gate, w, n_outer, n_inner, x_so, x_si, g_so, g_si, h, eps);
}

void gdn_gated_norm_bf16(uint16_t* out, const uint16_t* x, const uint16_t* gate,
                         const uint16_t* w, int64_t n_outer, int64_t n_inner, int64_t x_so,
                         int64_t x_si, int64_t g_so, int64_t g_si, int64_t h, float eps) {
  gated_rms_norm<BF16>(out, x, gate, w, n_outer, n_inner, x_so, x_si, g_so, g_si, h, eps);
}

void gdn_conv_bf16(uint16_t* out, const uint16_t* x, int64_t x_stride, const float* weight_t,
                   const float* bias, uint16_t* state, const int64_t* qsl, const int64_t* slots,
                   const uint8_t* has_init, int64_t R, int64_t D, int64_t K, int silu) {
  conv<BF16>(out, x, x_stride, weight_t, bias, state, qsl, slots, has_init, R, D, K, silu);
}

void gdn_gating_f32(float* g, float* beta, const float* a, const float* b, int64_t a_stride,
                    int64_t b_stride, const float* A_log, const float* dt_bias, int64_t T,
                    int64_t H) {
  gating<F32>(g, beta, a, b, a_stride, b_stride, A_log, dt_bias, T, H);
}

void gdn_gating_bf16(float* g, float* beta, const uint16_t* a, const uint16_t* b,
                     int64_t a_stride, int64_t b_stride, const float* A_log,
                     const float* dt_bias, int64_t T, int64_t H) {
  gating<BF16>(g, beta, a, b, a_stride, b_stride, A_log, dt_bias, T, H);
}

// The chunked prefill (ChunkArgs above). dtype: 0 f32, 1 bf16 (activations: q, k, v, out);
// pool_dtype: the state pool's, 0 f32, 1 bf16, 2 f16 (where gdn_has_f16_pool). Returns nonzero
// for a combination it does not build.
int gdn_chunk(const ChunkArgs* args, int dtype, int pool_dtype) {
  if (args->C % 8 || args->Dk % 8 || args->Dv % 8 || args->Hv % args->Hk) return 1;
  return with_types(dtype, pool_dtype, [&](auto d, auto p) {
    chunk_prefill<decltype(d), decltype(p)>(*args);
  });
}

}  // extern "C"
