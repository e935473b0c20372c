// Fused elementwise kernels of a decoder layer on CPU: one pass over memory where PyTorch's
// reference code makes three to six (each op reads and writes the whole tensor, and bf16 adds
// a conversion pass per op).
//
//   rms_norm      [residual add +] RMSNorm over rows (plain w * x_hat, or zero-centred
//                 x_hat * (1 + w)); rows addressed by two strides so per-head q/k norms
//                 (Qwen3) read the heads in place in the fused qkv output
//   silu_and_mul  silu(gate) * up from the merged [gate | up] projection
//   rotary        NeoX rotary embedding of q and k in place, cos/sin looked up per token
//   quantize_rows dynamic symmetric int8 per row (W8A8 activations): scale = absmax / 127
//   scale_rows    an fp32 GEMM result times one scale per row (the W8A8 token scale), cast
//   silu_mul_quantize  the W8A8 MLP's scale_rows + silu_and_mul + quantize_rows in one pass
//   sigmoid_gate  x * sigmoid(gate) per head, the gate read in place (Qwen3.5's gated
//                 attention output: its gate is a strided half of each q head's projection)
//
// Each reproduces the reference's roundings: bf16 values are widened to fp32, and rounded back
// to bf16 (nearest even, as torch) wherever the reference produces a bf16 tensor. fp32 results
// equal the reference's up to summation order (the RMS) and expf's last bit (SiLU); rotary is
// exact, since the library is built with -ffp-contract=off (no fused multiply-adds the
// reference does not do). No -ffast-math: `omp simd` reductions vectorise without it.
// Plain C++ over raw pointers, called through ctypes (see decode_attention.cpp).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The value a T tensor holds for x: x itself in fp32, x rounded to bf16 in bf16.
inline float round_to(float x, float) { return x; }
inline float round_to(float x, uint16_t) { return round_bf16(x); }

// Enough elements for a second thread to pay for waking it. A decode batch's norm (64 x 896,
// ~25-30 us on one thread) and rotary take both: between the decode step's GEMMs the OpenMP
// threads are awake, and the replayed dense step's 49 norms went 2.7 -> 1.5-1.8 ms, its 24
// rotaries 1.1-1.2 -> 0.7-0.8 ms (2026-12-06; at 1 << 17 they ran on one thread, chosen when a
// loaded machine made the second thread's wake-up cost more than it saved).
constexpr int64_t kParallelMin = 1 << 14;

// ---- RMSNorm ------------------------------------------------------------------------------
// Row r = (i, j), i < n_outer, j < n_inner, starts at x + i * x_so + j * x_si (residual alike);
// out and res_out are contiguous [n_outer * n_inner, h].
template <typename T>
void rms_norm_row(T* out, T* res_out, const T* x, const T* res, const T* w, int64_t h,
                  float eps, bool zero_centred, float* buf) {
  float ss = 0.f;
  if (res != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < h; ++k) {
      const float s = round_to(to_float(x[k]) + to_float(res[k]), T{});  // x + residual, in T
      store(res_out + k, s);
      buf[k] = s;
      ss += s * s;
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < h; ++k) {
      buf[k] = to_float(x[k]);
      ss += buf[k] * buf[k];
    }
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  if (zero_centred) {  // (x_hat * (1 + w)) in fp32, rounded once
#pragma omp simd
    for (int64_t k = 0; k < h; ++k) store(out + k, buf[k] * inv * (1.f + to_float(w[k])));
  } else {  // w * T(x_hat): the normalised row is a T tensor before the weight multiplies it
#pragma omp simd
    for (int64_t k = 0; k < h; ++k) store(out + k, to_float(w[k]) * round_to(buf[k] * inv, T{}));
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bf16 rows with AVX512-BF16's conversions (vec_math.h's to_bf16 / bf16_round): one instruction
// where the portable round_bf16 takes about ten integer operations per vector.
void rms_norm_row(uint16_t* out, uint16_t* res_out, const uint16_t* x, const uint16_t* res,
                  const uint16_t* w, int64_t h, float eps, bool zero_centred, float* buf) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t k = 0; k < h; k += 16) {
    const __mmask16 m = tail_mask(h - k);
    __m512 v = load_bf16(x + k, m);
    if (res != nullptr) {
      const __m256bh sum = to_bf16(_mm512_add_ps(v, load_bf16(res + k, m)));  // x + residual
      store_bf16(res_out + k, sum, m);
      v = _mm512_cvtpbh_ps(sum);
    }
    _mm512_storeu_ps(buf + k, v);  // buf holds h rounded up to 16 floats
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(h) + eps);
  const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
  for (int64_t k = 0; k < h; k += 16) {
    const __mmask16 m = tail_mask(h - k);
    const __m512 v = _mm512_loadu_ps(buf + k), wv = load_bf16(w + k, m);
    const __m512 y = zero_centred
                         ? _mm512_mul_ps(_mm512_mul_ps(v, vinv), _mm512_add_ps(one, wv))
                         : _mm512_mul_ps(wv, bf16_round(_mm512_mul_ps(v, vinv)));
    store_bf16(out + k, to_bf16(y), m);
  }
}
constexpr int64_t kRowPad = 16;  // the bf16 row's buffer is written in whole vectors
#else
constexpr int64_t kRowPad = 0;
#endif

template <typename T>
void rms_norm(T* out, T* res_out, const T* x, const T* res, const T* w, int64_t n_outer,
              int64_t n_inner, int64_t x_so, int64_t x_si, int64_t r_so, int64_t r_si,
              int64_t h, float eps, bool zero_centred) {
  const int64_t rows = n_outer * n_inner;
#pragma omp parallel if (rows * h >= kParallelMin)
  {
    float* buf = new float[h + kRowPad];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / n_inner, j = r % n_inner;
      rms_norm_row(out + r * h, res == nullptr ? nullptr : res_out + r * h,
                   x + i * x_so + j * x_si, res == nullptr ? nullptr : res + i * r_so + j * r_si,
                   w, h, eps, zero_centred, buf);
    }
    delete[] buf;
  }
}

// ---- SiLU and mul -------------------------------------------------------------------------
// With AVX512, 16 lanes of intrinsics (vec_math.h's silu16); elsewhere the portable loops, which
// GCC vectorises into 8 lanes with exp_approx ([512, 9728] bf16, 2 threads, AMX Xeon: 0.81 ms
// with those, where a copy of the same bytes takes 0.19 ms).
inline void silu_mul_row(float* o, const float* gate, const float* up, int64_t inter) {
#if defined(__AVX512F__)
  for (int64_t k = 0; k < inter; k += 16) {
    const __mmask16 m = tail_mask(inter - k);
    const __m512 silu = silu16(_mm512_maskz_loadu_ps(m, gate + k));
    _mm512_mask_storeu_ps(o + k, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, up + k)));
  }
#else
#pragma omp simd
  for (int64_t k = 0; k < inter; ++k) o[k] = gate[k] / (1.f + exp_approx(-gate[k])) * up[k];
#endif
}

// bf16: silu(gate) is rounded to bf16 (a bf16 tensor in the reference), the product rounded
// once. With AVX512-BF16 the roundings and conversions are single instructions (see
// rms_norm_row above); without, the vectoriser widens and narrows 16-bit lanes poorly, so each
// row is widened into fp32 buffers in chunks and computed there.
inline void silu_mul_row(uint16_t* o, const uint16_t* gate, const uint16_t* up, int64_t inter) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const uint16_t* table = silu_table_choice() ? silu_bf16_table() : nullptr;
  for (int64_t k = 0; k < inter; k += 16) {
    const __mmask16 m = tail_mask(inter - k);
    const __m512 silu = table ? silu_bf16(table, gate + k, m)
                              : _mm512_cvtpbh_ps(to_bf16(silu16(load_bf16(gate + k, m))));
    store_bf16(o + k, to_bf16(_mm512_mul_ps(silu, load_bf16(up + k, m))), m);
  }
#else
  constexpr int64_t CHUNK = 512;
  alignas(64) uint32_t g[CHUNK], u[CHUNK];
  for (int64_t k0 = 0; k0 < inter; k0 += CHUNK) {
    const int64_t n = inter - k0 < CHUNK ? inter - k0 : CHUNK;
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) {
      g[k] = static_cast<uint32_t>(gate[k0 + k]) << 16;
      u[k] = static_cast<uint32_t>(up[k0 + k]) << 16;
    }
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) {
      float gf, uf;
      std::memcpy(&gf, &g[k], sizeof gf);
      std::memcpy(&uf, &u[k], sizeof uf);
      const float prod = round_bf16(gf / (1.f + exp_approx(-gf))) * uf;  // silu(gate) in bf16
      const float y = round_bf16(prod);
      std::memcpy(&g[k], &y, sizeof y);
    }
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) o[k0 + k] = static_cast<uint16_t>(g[k] >> 16);
  }
#endif
}

// Rows of [gate | up] (x_stride apart) -> rows of silu(gate) * up.
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t inter, int64_t x_stride) {
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * x_stride;
    silu_mul_row(out + r * inter, gate, gate + inter, inter);
  }
}

// ---- Sigmoid gate --------------------------------------------------------------------------
// out [T, H * D] (contiguous) = x * sigmoid(gate), token t's head h at x + t * x_so + h * x_si
// and gate + t * g_so + h * g_si: sigmoid(gate) rounded to T, the product rounded once, as the
// reference's `x * torch.sigmoid(gate)` in T (sigmoid to ~1 ulp of expf).
template <typename T>
void sigmoid_gate(T* out, const T* x, const T* gate, int64_t tokens, int64_t heads, int64_t d,
                  int64_t x_so, int64_t x_si, int64_t g_so, int64_t g_si) {
#pragma omp parallel for schedule(static) if (tokens * heads * d >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + t * x_so + h * x_si;
      const T* gr = gate + t * g_so + h * g_si;
      T* o = out + (t * heads + h) * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) {
        const float s = round_to(1.0f / (1.0f + exp_approx(-to_float(gr[k]))), T{});
        store(o + k, round_to(to_float(xr[k]) * s, T{}));
      }
    }
  }
}

// ---- Rotary -------------------------------------------------------------------------------
// x [T, H, D] at x + t * stride + h * D; rotates dims [0, rot) of each head in place:
//   x1' = x1 * c - x2 * s,  x2' = x2 * c + x1 * s   (halves of width rot / 2)
// with c, s the fp32 table rows of the token's position rounded to T, and each product and the
// sum rounded to T, as the reference's `rot * cos + rotate_half(rot) * sin` in T.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t d, int64_t rot, const float* cos,
                  const float* sin) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * d;
#pragma omp simd
    for (int64_t k = 0; k < half; ++k) {
      const float x1 = to_float(xh[k]), x2 = to_float(xh[k + half]);
      const float c1 = round_to(cos[k], T{}), s1 = round_to(sin[k], T{});
      const float c2 = round_to(cos[k + half], T{}), s2 = round_to(sin[k + half], T{});
      const float a1 = round_to(x1 * c1, T{}), b1 = round_to(-x2 * s1, T{});
      const float a2 = round_to(x2 * c2, T{}), b2 = round_to(x1 * s2, T{});
      store(xh + k, a1 + b1);
      store(xh + k + half, a2 + b2);
    }
  }
}

template <typename T>
int rotary(T* q, T* k, const int64_t* positions, const float* cos, const float* sin,
           int64_t tokens, int64_t q_stride, int64_t k_stride, int64_t hq, int64_t hk,
           int64_t d, int64_t rot, int64_t max_position) {
  if (rot % 2 != 0 || rot > d) return 1;
  for (int64_t t = 0; t < tokens; ++t)
    if (positions[t] < 0 || positions[t] >= max_position) return 2;
#pragma omp parallel for schedule(static) if (tokens * (hq + hk) * rot >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + positions[t] * rot;
    const float* s = sin + positions[t] * rot;
    rotate_heads(q + t * q_stride, hq, d, rot, c, s);
    rotate_heads(k + t * k_stride, hk, d, rot, c, s);
  }
  return 0;
}

// ---- int8 per row ---------------------------------------------------------------------------
// As quantization/kernels.py's quantize_per_token, to the same integers and scales: scale =
// max(absmax, 1e-10) / 127 and q = round-half-even(clamp(x * (1 / scale), -128, 127)) in fp32.
// One pass to find the row's absmax, one to write it; the reference runs about ten torch ops
// per call (each a pass, and a thread wake-up), which cost more than the int8 GEMM's saving at
// decode sizes.
template <typename T>
void quantize_row(int8_t* qr, float* scale, const T* xr, int64_t k) {
  constexpr float kRounder = 1.5f * 8388608.0f;  // v + R - R rounds half to even for |v| < 2^22
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < k; ++i) {
    const float a = std::fabs(to_float(xr[i]));
    amax = a > amax ? a : amax;
  }
  const float s = (amax > 1e-10f ? amax : 1e-10f) / 127.0f;
  *scale = s;
  const float inv = 1.0f / s;
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) {
    float v = to_float(xr[i]) * inv;
    v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
    qr[i] = static_cast<int8_t>(static_cast<int32_t>((v + kRounder) - kRounder));
  }
}

template <typename T>
void quantize_rows(int8_t* q, float* scale, const T* x, int64_t rows, int64_t k,
                   int64_t x_stride) {
#pragma omp parallel for schedule(static) if (rows * k >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) quantize_row(q + r * k, scale + r, x + r * x_stride, k);
}

// o[:] = a[:] * s, rounded to T: the per-token half of the W8A8 epilogue in one pass (torch: a
// multiply and a cast, two passes and two thread wake-ups).
template <typename T>
inline void scale_row(T* o, const float* a, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(o + i, a[i] * s);
}

template <typename T>
void scale_rows(T* out, const float* acc, const float* row_scale, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) scale_row(out + r * n, acc + r * n, row_scale[r], n);
}

// The W8A8 MLP's middle, row by row with the row in cache: the gate_up GEMM's fp32 result
// acc [rows, 2I] (channel scales applied) times the row's token scale, rounded to T (scale_row),
// silu(gate) * up (silu_mul_row), quantized for the down projection (quantize_row): the same
// functions as the three separate kernels, so the same integers and scales, without the two
// T tensors between them going through memory and three calls instead of one.
template <typename T>
void silu_mul_quantize(int8_t* q, float* scale, const float* acc, const float* row_scale,
                       int64_t rows, int64_t inter) {
#pragma omp parallel if (rows * inter >= kParallelMin)
  {
    static thread_local std::vector<T> gate_up, y;  // one row each, reused across calls
    gate_up.resize(2 * inter);
    y.resize(inter);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      scale_row(gate_up.data(), acc + r * 2 * inter, row_scale[r], 2 * inter);
      silu_mul_row(y.data(), gate_up.data(), gate_up.data() + inter, inter);
      quantize_row(q + r * inter, scale + r, y.data(), inter);
    }
  }
}

}  // namespace

extern "C" {

void rms_norm_f32(float* out, float* res_out, const float* x, const float* res, const float* w,
                  int64_t n_outer, int64_t n_inner, int64_t x_so, int64_t x_si, int64_t r_so,
                  int64_t r_si, int64_t h, float eps, int zero_centred) {
  rms_norm(out, res_out, x, res, w, n_outer, n_inner, x_so, x_si, r_so, r_si, h, eps,
           zero_centred != 0);
}
void rms_norm_bf16(uint16_t* out, uint16_t* res_out, const uint16_t* x, const uint16_t* res,
                   const uint16_t* w, int64_t n_outer, int64_t n_inner, int64_t x_so,
                   int64_t x_si, int64_t r_so, int64_t r_si, int64_t h, float eps,
                   int zero_centred) {
  rms_norm(out, res_out, x, res, w, n_outer, n_inner, x_so, x_si, r_so, r_si, h, eps,
           zero_centred != 0);
}

void silu_and_mul_f32(float* out, const float* x, int64_t rows, int64_t inter,
                      int64_t x_stride) {
  silu_and_mul(out, x, rows, inter, x_stride);
}
void silu_and_mul_bf16(uint16_t* out, const uint16_t* x, int64_t rows, int64_t inter,
                       int64_t x_stride) {
  silu_and_mul(out, x, rows, inter, x_stride);
}

// Each returns 0; 1 for an odd or too wide rotary_dim; 2 for a position outside the table.
void sigmoid_gate_f32(float* out, const float* x, const float* gate, int64_t tokens,
                      int64_t heads, int64_t d, int64_t x_so, int64_t x_si, int64_t g_so,
                      int64_t g_si) {
  sigmoid_gate(out, x, gate, tokens, heads, d, x_so, x_si, g_so, g_si);
}
void sigmoid_gate_bf16(uint16_t* out, const uint16_t* x, const uint16_t* gate, int64_t tokens,
                       int64_t heads, int64_t d, int64_t x_so, int64_t x_si, int64_t g_so,
                       int64_t g_si) {
  sigmoid_gate(out, x, gate, tokens, heads, d, x_so, x_si, g_so, g_si);
}

int rotary_f32(float* q, float* k, const int64_t* positions, const float* cos, const float* sin,
               int64_t tokens, int64_t q_stride, int64_t k_stride, int64_t hq, int64_t hk,
               int64_t d, int64_t rot, int64_t max_position) {
  return rotary(q, k, positions, cos, sin, tokens, q_stride, k_stride, hq, hk, d, rot,
                max_position);
}
int rotary_bf16(uint16_t* q, uint16_t* k, const int64_t* positions, const float* cos,
                const float* sin, int64_t tokens, int64_t q_stride, int64_t k_stride, int64_t hq,
                int64_t hk, int64_t d, int64_t rot, int64_t max_position) {
  return rotary(q, k, positions, cos, sin, tokens, q_stride, k_stride, hq, hk, d, rot,
                max_position);
}

void quantize_rows_f32(int8_t* q, float* scale, const float* x, int64_t rows, int64_t k,
                       int64_t x_stride) {
  quantize_rows(q, scale, x, rows, k, x_stride);
}
void quantize_rows_bf16(int8_t* q, float* scale, const uint16_t* x, int64_t rows, int64_t k,
                        int64_t x_stride) {
  quantize_rows(q, scale, x, rows, k, x_stride);
}

void silu_mul_quantize_f32(int8_t* q, float* scale, const float* acc, const float* row_scale,
                           int64_t rows, int64_t inter) {
  silu_mul_quantize<float>(q, scale, acc, row_scale, rows, inter);
}
void silu_mul_quantize_bf16(int8_t* q, float* scale, const float* acc, const float* row_scale,
                            int64_t rows, int64_t inter) {
  silu_mul_quantize<uint16_t>(q, scale, acc, row_scale, rows, inter);
}
void scale_rows_f32(float* out, const float* acc, const float* row_scale, int64_t rows,
                    int64_t n) {
  scale_rows(out, acc, row_scale, rows, n);
}
void scale_rows_bf16(uint16_t* out, const float* acc, const float* row_scale, int64_t rows,
                     int64_t n) {
  scale_rows(out, acc, row_scale, rows, n);
}

// Whether bf16 SiLU-and-mul looks SiLU up in vec_math.h's table (on = 1) or computes it (0),
// process-wide (the same bits either way; the default is silu_table_choice's): a switch for
// tests and benchmarks. Returns the previous choice, or -1 where the build has no table (no
// AVX512-BF16).
int silu_use_table(int on) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int previous = silu_table_choice();
  silu_table_choice() = on ? 1 : 0;
  return previous;
#else
  (void)on;
  return -1;
#endif
}

}  // extern "C"
