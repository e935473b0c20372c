// Vectorisable float maths and the bf16 conversions shared by the kernels (included, not a
// library of its own; the build's cache key hashes every header of csrc/ with the sources).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// Flushes subnormal results and inputs to zero on this thread while it lives, restoring the
// caller's mode after: Intel cores take a microcode assist per subnormal operand. The Gated
// DeltaNet chunked prefill's decays (exp of summed log gates) underflow into subnormals (a
// Qwen3.5-0.8B-shaped step took 6.9 s on a Sapphire Rapids Xeon, 78% of it assists); the
// sampler's top-p draw pass ran 2x slower without it. Values below 1.2e-38 change nothing a
// bf16 or fp32 model can show, nor a sampling weight relative to the row's largest (1). Set
// per call, not per process (as -ffast-math's start-up code would), so torch's own maths is
// untouched.
struct FlushSubnormals {
#if defined(__SSE__)
  unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ | DAZ
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

// a * b + c, fused where the machine has FMA (SiLU's result is not bit-exact anyway; the
// library's -ffp-contract=off keeps the other kernels exact).
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// expf to ~1 ulp in a form GCC vectorises (Cephes' polynomial; 2^n by exponent bits).
inline float exp_approx(float x) {
  const float hi = 88.3762626647949f, lo = -87.3365447504f;
  const bool over = x > hi, under = x < lo;
  x = over ? hi : (under ? lo : x);
  const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = madd(x, 1.44269504088896341f, magic) - magic;
  float r = madd(n, -0.693359375f, x);
  r = madd(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  p = madd(p * r, r, r + 1.f);
  // 2^n as two factors: n reaches 128 at the top of the range, past float's exponent.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const uint32_t b1 = static_cast<uint32_t>(n1 + 127) << 23, b2 = static_cast<uint32_t>(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  const float e = p * s1 * s2;
  return over ? INFINITY : (under ? 0.f : e);
}

// bf16 is stored as its bits (uint16_t): the high half of a float32.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// x rounded to bf16 (nearest even, as torch; NaN becomes the quiet NaN 0x7fc0), kept as the fp32
// value it stands for: 32-bit integer ops only, which vectorise where 16-bit lanes do not.
inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t r = (bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : rounded;
  float f;
  std::memcpy(&f, &r, sizeof f);
  return f;
}
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  const float r = round_bf16(x);
  std::memcpy(&bits, &r, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) { *dst = bf16_bits(x); }

// The largest of x[0..n) (-inf for n == 0), in a form GCC vectorises: std::max's NaN ordering
// kept it a scalar chain of dependent maxss (a fifth of the decode-attention kernel's time).
inline float max_of(const float* x, int64_t n) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  return mx;
}

#if defined(__AVX512F__)
// The first `left` of 16 lanes (none for left <= 0): the mask of a row's tail.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0);
}

// 16 bf16 values (their bits) widened to fp32: exact, a shift of each into the high half (what
// _mm512_cvtpbh_ps compiles to, without needing AVX512-BF16).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}

// The largest of x[0..n) (-inf for n == 0): four 16-lane maxima side by side (one chain of
// dependent maxima was a tenth of the prefill attention kernel's time). Not max_of above: with
// four (or eight) partial maxima and 512-bit vectors that one still left the prefill kernel
// 1.1-1.2x slower at 256-1,024 tokens (its scalar tails and the call on the many short causal
// rows; 2026-12-05).
inline float max16(const float* x, int64_t n) {
  __m512 m[4];
  for (auto& v : m) v = _mm512_set1_ps(-__builtin_inff());
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 4; ++j) m[j] = _mm512_max_ps(m[j], _mm512_loadu_ps(x + i + 16 * j));
  for (; i < n; i += 16) {
    const __mmask16 valid = tail_mask(n - i);
    m[0] = _mm512_mask_max_ps(m[0], valid, m[0], _mm512_maskz_loadu_ps(valid, x + i));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
}

#if defined(__AVX512BF16__)
// fp32 to bf16 with AVX512-BF16's conversion: vcvtneps2bf16 rounds 16 floats to bf16 (nearest
// even, NaN kept NaN) in one instruction, where the portable round_bf16 takes about ten integer
// operations per vector (it made elementwise.cpp's RMSNorm instruction-bound: [2048, 896] with
// the residual add, 920 us, 1 thread). Same values and roundings, but for fp32 subnormals,
// which the instruction flushes to zero (|x| < 1.2e-38: not a value a hidden state holds).
inline __m256bh to_bf16(__m512 v) { return _mm512_cvtneps_pbh(v); }
inline __m512 bf16_round(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }
inline void store_bf16(uint16_t* p, __m256bh v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)v);
}
#endif

// e^x in 16 lanes, ~1 ulp (Cephes' expf polynomial on x - n ln2, scaled by 2^n with vscalefps,
// which gives inf past the float range and needs no exponent-bit arithmetic); x is clamped to
// [-87.3, 89] first, so it is ~1e-38 where expf underflows to 0 and inf where it overflows; NaN
// stays NaN. exp_approx above is the same polynomial in a form GCC vectorises, in 8 lanes with
// selects for the range ends: 2-3x slower, and most of a softmax's or SiLU's time with it.
inline __m512 exp16(__m512 x) {
  // max/min return their second operand when either is NaN: a NaN x is kept
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// silu(g) = g / (1 + e^-g) in 16 lanes, as the reference computes it (the division exact, e^-g
// ~1 ulp): -0 for very negative g (1 + inf), g for large g, NaN for NaN and for g = -inf.
inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

#if defined(__AVX512BF16__)
// silu16 of every bf16 value, rounded to bf16 (entry b: the bits of round_bf16(silu(b)), NaN
// inputs included), built once per process: a bf16 input has 65,536 values, so a SiLU rounded to
// bf16 is one table lookup, bit for bit the computed one. Computed, the exponential and the
// division bound it (~20 cycles a 16-lane vector: [2,048, 9,728] bf16 4.3 ms on 2 cores against
// ~0.8 for a copy of its bytes); a gather from the table's hot part (the few exponents
// activations take, a few KB) stays in L1. Two entries of padding: each lookup reads 32 bits.
inline const uint16_t* silu_bf16_table() {
  static const uint16_t* table = [] {
    auto* t = new uint16_t[65536 + 2]();
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int32_t b = 0; b < 65536; b += 16) {
      const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(b), lanes), 16);
      const __m256bh y = _mm512_cvtneps_pbh(silu16(_mm512_castsi512_ps(bits)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + b), (__m256i)y);
    }
    return t;
  }();
  return table;
}

// Whether SiLU of bf16 values is looked up (silu_bf16_table) or computed (silu16, then rounded:
// the same bits). The lookup is an AVX-512 gather: 1.8x faster than computing on an Emerald
// Rapids Xeon, where gathers are fast, but 1.5x slower on an AMD Zen 5 EPYC, where they are
// microcoded (docs/benchmarks.md, "SiLU computed where gathers are slow"). So: Intel CPUs look
// up, others compute; elementwise_silu_table() overrides it for a process (tests run both).
inline int& silu_table_choice() {
  static int choice = __builtin_cpu_is("intel") ? 1 : 0;
  return choice;
}

// round_bf16(silu(g)) of 16 bf16 values (their bits as 32-bit lanes; lanes past m: 0) from
// silu_bf16_table(), widened.
inline __m512 silu_bf16(const uint16_t* table, __m512i g, __mmask16 m = 0xFFFF) {
  const __m512i entry = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, g, table, 2);
  return _mm512_castsi512_ps(_mm512_slli_epi32(entry, 16));
}

// The same of 16 bf16 values in memory.
inline __m512 silu_bf16(const uint16_t* table, const uint16_t* g, __mmask16 m) {
  return silu_bf16(table, _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, g)), m);
}

// The same of 16 floats rounded to bf16 first: bf16_round(silu16(bf16_round(g))).
inline __m512 silu_bf16(const uint16_t* table, __m512 g) {
  return silu_bf16(table, _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(g)));
}
#endif
#endif

}  // namespace
