// W8A8's GEMM on AVX512-VNNI CPUs without AMX (AMD Zen 4/5, Intel Ice Lake / Cascade Lake), on
// an int8 weight packed once, with the W8A8 scaling in the epilogue:
//
//   y[m, n] = T(T32(T32(float(sum_k x[m, k] * w[n, k] + bias[n]) * scale[n]) * token_scale[m]))
//             (+ out_bias[n], rounded again, as a layer's float bias is added to y)
//
// with bias [N] int32, token_scale [M] and out_bias [N] optional: igemm.cpp's values (and
// platforms/base.py's int32_epilogue's) from exact int32 sums. Where oneDNN's packed int8 GEMM
// runs its reference path (0.2 GOP/s on a Zen 5 EPYC, cpu_packed_gemm.int8_packing_pays), W8A8
// otherwise has torch._int_mm, which reorders the plain weight on every call.
//
// vpdpbusd multiplies 16 x 4 unsigned bytes by signed bytes and adds each quad's four products
// to one int32 lane; x is signed, so it enters as x + 128 (a flipped top bit), and the pack keeps
// each column's 128 * sum_k w[n, k], subtracted from the sums in the epilogue (exact: |sums| stay
// below 2^31 for K < 2^16). The weight is packed into panels of 64 columns of k-quads,
// [N / 64][K / 4][64][4] (the last panel and K's last quad padded with zeros), followed by the
// 64 int32 corrections of each panel; each micro-kernel step loads a quad's 4 panel vectors and
// broadcasts the quad of each of 6 rows of x: 24 accumulators, pbgemm.cpp's bf16 structure
// (its tasks, its prefetch of a thread's next panel) at twice the products a step.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 64;       // output columns a panel (4 vectors of 16)
constexpr int64_t RB = 6;           // rows of x a micro-kernel call
constexpr int64_t ROW_CHUNK = 192;  // rows of x a task (a multiple of RB)

int64_t panels_of(int64_t N) { return (N + PANEL - 1) / PANEL; }
int64_t quads_of(int64_t K) { return (K + 3) / 4; }
// bytes of a panel's weight quads (its corrections follow all panels)
int64_t panel_bytes(int64_t K) { return quads_of(K) * 4 * PANEL; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define QS_PIGEMM 1

// How a micro-kernel's scaled sums leave: into y (kStore), as the gate of an MLP's gate_up
// projection into a small fp32 buffer [R][64] (kGate), or as silu(gate) * up into y with that
// buffer (kSiluMul: the up panel's call).
enum Out { kStore, kGate, kSiluMul };

// A task's view of the epilogue: 64 columns' scaling (0 past N), the token scales of its rows.
struct Columns {
  alignas(64) int32_t correction[PANEL];  // 128 * sum_k w[n, k] - bias[n]
  alignas(64) float scale[PANEL];
  alignas(64) float out_bias[PANEL];  // a layer's float bias (bf16 ones widened), or 0
};

struct Output {
  void* y;                   // [M, N] bf16 or float32
  int64_t N;                 // its row stride
  const float* token_scale;  // [M] or null
  bool out_bf16;
  bool out_bias;
};

// v rounded to bf16 (nearest even, NaN kept quiet), as 16 bf16 values: one instruction with
// AVX512-BF16, integer steps without it (VNNI CPUs before Zen 4 / Cooper Lake).
inline __m256i bf16_lanes(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

// v as a bf16 tensor holds it, widened back (exact).
inline __m512 round_bf16v(__m512 v) {
  return widen_bf16(bf16_lanes(v));
}

// silu(g) of bf16 values g (as floats), rounded to bf16: elementwise.cpp's bf16 SiLU-and-mul
// (looked up in vec_math.h's table where it looks up, else computed: the same bits).
inline __m512 silu_rounded(__m512 g) {
#if defined(__AVX512BF16__)
  if (silu_table_choice()) return silu_bf16(silu_bf16_table(), g);
#endif
  return round_bf16v(silu16(g));
}

// A quad step's 4 weight vectors (64 columns x 4 k), and one row's 4 accumulators of them.
struct Weights {
  __m512i b0, b1, b2, b3;
};
struct Sums {
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0;
};

// s += one row's quad of x + 128 (4 unsigned bytes at x) times the step's weights.
inline void dot_row(Sums& s, const uint8_t* x, const Weights& w) {
  int32_t v;
  std::memcpy(&v, x, 4);
  const __m512i a = _mm512_set1_epi32(v);
  s.c0 = _mm512_dpbusd_epi32(s.c0, a, w.b0);
  s.c1 = _mm512_dpbusd_epi32(s.c1, a, w.b1);
  s.c2 = _mm512_dpbusd_epi32(s.c2, a, w.b2);
  s.c3 = _mm512_dpbusd_epi32(s.c3, a, w.b3);
}

inline void store_row(int32_t* dst, const Sums& s) {
  _mm512_store_si512(dst, s.c0);
  _mm512_store_si512(dst + 16, s.c1);
  _mm512_store_si512(dst + 32, s.c2);
  _mm512_store_si512(dst + 48, s.c3);
}

// R rows of x + 128 (xu: unsigned bytes, rows ldu apart, padded to whole quads) against a
// panel: sums over K, then the scaling into y's columns n0 .. n0 + cols - 1 of rows m .. m+R-1.
// ahead / ahead_lines: the next panel's lines fetched a step (into L1: 1.02x over the L2
// hint at one row of x, where the panel is read once). The rows' sums are named
// variables, not an array: GCC 12 kept a [6][4] array of them on the stack through the loop
// (loads and stores around every vpdpbusd; 0.8 of the kernel's speed).
template <int R, Out OUT>
void micro(const uint8_t* xu, int64_t ldu, const int8_t* panel, int64_t quads,
           const int8_t* ahead, int64_t ahead_lines, const Columns& c, const Output& out,
           int64_t m, int64_t n0, int64_t cols, float* gate) {
  Sums s0, s1, s2, s3, s4, s5;
  for (int64_t q = 0; q < quads; ++q) {
    for (int64_t j = 0; j < ahead_lines; ++j)  // prefetches never fault past the end
      _mm_prefetch(reinterpret_cast<const char*>(ahead + (q * ahead_lines + j) * 64),
                   _MM_HINT_T0);
    const int8_t* wk = panel + q * 4 * PANEL;
    const Weights w{_mm512_loadu_si512(wk), _mm512_loadu_si512(wk + 64),
                    _mm512_loadu_si512(wk + 128), _mm512_loadu_si512(wk + 192)};
    const uint8_t* x = xu + 4 * q;
    dot_row(s0, x, w);
    if constexpr (R > 1) dot_row(s1, x + ldu, w);
    if constexpr (R > 2) dot_row(s2, x + 2 * ldu, w);
    if constexpr (R > 3) dot_row(s3, x + 3 * ldu, w);
    if constexpr (R > 4) dot_row(s4, x + 4 * ldu, w);
    if constexpr (R > 5) dot_row(s5, x + 5 * ldu, w);
  }
  alignas(64) int32_t sums[R][PANEL];  // what the epilogue's loops index
  store_row(sums[0], s0);
  if constexpr (R > 1) store_row(sums[1], s1);
  if constexpr (R > 2) store_row(sums[2], s2);
  if constexpr (R > 3) store_row(sums[3], s3);
  if constexpr (R > 4) store_row(sums[4], s4);
  if constexpr (R > 5) store_row(sums[5], s5);
  const uint64_t live = cols >= PANEL ? ~uint64_t{0} : (uint64_t{1} << cols) - 1;
  for (int i = 0; i < R; ++i) {
    const float ts = out.token_scale ? out.token_scale[m + i] : 1.f;
    for (int n = 0; n < 4; ++n) {
      const __mmask16 mask = static_cast<__mmask16>(live >> (16 * n));
      const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(sums[i] + 16 * n),
                                           _mm512_load_si512(c.correction + 16 * n));
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_load_ps(c.scale + 16 * n));
      if (out.token_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(ts));
      if constexpr (OUT == kGate) {  // the gate as its y would hold it, kept for the up panel
        _mm512_store_ps(gate + i * PANEL + 16 * n, out.out_bf16 ? round_bf16v(v) : v);
        continue;
      }
      if constexpr (OUT == kSiluMul) {  // v: up; silu(gate) * up as elementwise.cpp rounds it
        const __m512 g = _mm512_load_ps(gate + i * PANEL + 16 * n);
        v = _mm512_mul_ps(out.out_bf16 ? silu_rounded(g) : silu16(g),
                          out.out_bf16 ? round_bf16v(v) : v);
      }
      const __m512 ob = _mm512_load_ps(c.out_bias + 16 * n);
      const int64_t at = (m + i) * out.N + n0 + 16 * n;
      if (out.out_bf16) {
        // y rounds first, then y + bias rounds again, as in PyTorch (exact widening shifts)
        __m256i y16 = bf16_lanes(v);
        if (out.out_bias) {
          y16 = bf16_lanes(_mm512_add_ps(widen_bf16(y16), ob));
        }
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.y) + at, mask, y16);
      } else {
        if (out.out_bias) v = _mm512_add_ps(v, ob);
        _mm512_mask_storeu_ps(static_cast<float*>(out.y) + at, mask, v);
      }
    }
  }
}

using Micro = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int8_t*, int64_t,
                       const Columns&, const Output&, int64_t, int64_t, int64_t, float*);
template <Out OUT>
constexpr Micro kMicro[RB] = {micro<1, OUT>, micro<2, OUT>, micro<3, OUT>,
                              micro<4, OUT>, micro<5, OUT>, micro<6, OUT>};

// Panel p's scaling columns: its corrections (less the int32 bias), scales and float bias, 16
// at a time with masked loads (0 past N): a scalar loop here was a third of a one-row task's
// work (a 64-column panel of K = 896 is 224 quad steps).
void panel_columns(Columns& c, const int32_t* corrections, const float* scale,
                   const int32_t* bias, const void* out_bias, bool out_bf16, int64_t p,
                   int64_t N) {
  for (int64_t j = 0; j < PANEL; j += 16) {
    const int64_t n = p * PANEL + j;
    const __mmask16 in = tail_mask(N - n);
    __m512i corr = _mm512_loadu_si512(corrections + n);  // the pack wrote 64 a panel
    if (bias) corr = _mm512_sub_epi32(corr, _mm512_maskz_loadu_epi32(in, bias + n));
    _mm512_store_si512(c.correction + j, corr);
    _mm512_store_ps(c.scale + j, _mm512_maskz_loadu_ps(in, scale + n));
    __m512 ob = _mm512_setzero_ps();
    if (out_bias && out_bf16) {
      ob = load_bf16(static_cast<const uint16_t*>(out_bias) + n, in);
    } else if (out_bias) {
      ob = _mm512_maskz_loadu_ps(in, static_cast<const float*>(out_bias) + n);
    }
    _mm512_store_ps(c.out_bias + j, ob);
  }
}

// y [M, N] from x and the packed weight (kStore), or y [M, N] = silu(gate) * up of a merged
// w [2N, K], N % 64 == 0 (kSiluMul: gate panel p, then up panel N / 64 + p, a row block at a
// time). Tasks are (panel, chunk of rows), panel-major: a thread's consecutive tasks reuse its
// panel from L2 and each panel is read from memory about once whatever the rows. The first row
// block reads the panel from memory, so the blocks fetch the thread's next panel meanwhile:
// its lines spread over the first blocks, up to 4 a step (1, 2 or 4 by the blocks a task has).
template <Out OUT>
void run(void* y, const int8_t* x, int64_t ldx, const int8_t* packed, const float* scale,
         const float* token_scale, const int32_t* bias, const void* out_bias, bool out_bf16,
         int64_t M, int64_t N, int64_t K) {
  constexpr bool fused = OUT == kSiluMul;
  const int64_t panels = panels_of(N), chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t all = fused ? 2 * panels : panels;  // panels in the packed copy
  const int64_t size = panel_bytes(K), lines = size / 64, quads = quads_of(K);
  const int32_t* corrections = reinterpret_cast<const int32_t*>(packed + all * size);
  const Output out{y, N, token_scale, out_bf16, out_bias != nullptr};
  // x + 128 as unsigned bytes (the top bit flipped), K padded to whole quads (w is 0 there)
  static thread_local std::vector<uint8_t> flipped;
  const int64_t ldu = 4 * quads;
  flipped.resize(M * ldu);
  uint8_t* xu = flipped.data();
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < ldu; ++k) xu[m * ldu + k] = k < K ? uint8_t(x[m * ldx + k]) ^ 0x80 : 0;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < panels * chunks; ++task) {
    const int64_t p = task / chunks, m0 = task % chunks * ROW_CHUNK;
    const int64_t m1 = std::min(M, m0 + ROW_CHUNK), cols = std::min(PANEL, N - p * PANEL);
    Columns c, cu;  // the panel's scaling columns; the up panel's (fused)
    panel_columns(c, corrections, scale, bias, out_bias, out_bf16, p, fused ? 2 * N : N);
    if (fused) panel_columns(cu, corrections, scale, bias, nullptr, out_bf16, panels + p, 2 * N);
    const int8_t* panel = packed + p * size;
    const int8_t* up = fused ? panel + panels * size : nullptr;
    const bool more = p + 1 < panels;
    const int64_t blocks = (m1 - m0 + RB - 1) / RB, per_step = (4 + blocks - 1) / blocks;
    alignas(64) float gate[RB * PANEL];
    for (int64_t m = m0, blk = 0; m < m1; m += RB, ++blk) {
      const int64_t rows = std::min(RB, m1 - m), first_line = blk * per_step * quads;
      const int64_t ahead = more && first_line < lines ? per_step : 0;
      const int8_t* next_lines = more ? panel + size + first_line * 64 : nullptr;
      if constexpr (fused) {
        kMicro<kGate>[rows - 1](xu + m * ldu, ldu, panel, quads, next_lines, ahead, c, out, m,
                                p * PANEL, cols, gate);
        kMicro<kSiluMul>[rows - 1](xu + m * ldu, ldu, up, quads,
                                   more ? up + size + first_line * 64 : nullptr, ahead, cu, out,
                                   m, p * PANEL, cols, gate);
      } else {
        kMicro<kStore>[rows - 1](xu + m * ldu, ldu, panel, quads, next_lines, ahead, c, out, m,
                                 p * PANEL, cols, gate);
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// 1 where this build runs the kernel (AVX512-VNNI and AVX512-BW), else 0.
int pigemm_available() {
#if defined(QS_PIGEMM)
  return 1;
#else
  return 0;
#endif
}

// Bytes of w [N, K]'s packed copy: the panels' quads, then 64 int32 corrections a panel.
int64_t pigemm_packed_size(int64_t N, int64_t K) {
  return panels_of(N) * (panel_bytes(K) + PANEL * 4);
}

// w [N, K] int8 (contiguous) -> dst (pigemm_packed_size bytes): panel p, quad q, column c holds
// w[64 p + c, 4 q .. 4 q + 3] (0 past N and K); then each column's 128 * sum_k w[n, k] as int32.
void pigemm_pack(int8_t* dst, const int8_t* w, int64_t N, int64_t K) {
  const int64_t panels = panels_of(N), quads = quads_of(K);
  int32_t* corrections = reinterpret_cast<int32_t*>(dst + panels * panel_bytes(K));
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    int8_t* panel = dst + p * panel_bytes(K);
    for (int64_t c = 0; c < PANEL; ++c) {
      const int64_t n = p * PANEL + c;
      int32_t sum = 0;
      for (int64_t q = 0; q < quads; ++q)
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t k = 4 * q + j;
          const int8_t v = n < N && k < K ? w[n * K + k] : 0;
          panel[(q * PANEL + c) * 4 + j] = v;
          sum += v;
        }
      int32_t correction = 128 * sum;
      std::memcpy(corrections + n, &correction, 4);
    }
  }
}

// x [M, K] int8 (rows ldx apart), the packed weight of w [N, K], scale [N] float32, token_scale
// [M] float32 or null, bias [N] int32 or null, out_bias [N] (y's dtype) or null -> y [M, N]
// (bf16 where out_bf16, else float32; contiguous). See the top of the file. 0 on success; 1:
// shapes not supported or no AVX512-VNNI in this build.
int pigemm_s8_scaled(void* y, const int8_t* x, int64_t ldx, const int8_t* packed,
                     const float* scale, const float* token_scale, const int32_t* bias,
                     const void* out_bias, int out_bf16, int64_t M, int64_t N, int64_t K) {
#if defined(QS_PIGEMM)
  if (M <= 0 || N <= 0 || K <= 0 || K >= (int64_t{1} << 16) || ldx < K) return 1;
  run<kStore>(y, x, ldx, packed, scale, token_scale, bias, out_bias, out_bf16 != 0, M, N, K);
  return 0;
#else
  (void)y, (void)x, (void)ldx, (void)packed, (void)scale, (void)token_scale, (void)bias,
      (void)out_bias, (void)out_bf16, (void)M, (void)N, (void)K;
  return 1;
#endif
}

// A W8A8 MLP's gate_up projection with its SiLU-and-mul: the packed weight of the merged
// w [2I, K] (I gate rows, then I up rows; I % 64 == 0, so no panel holds both), x, scale [2I],
// token_scale [M], bias [2I] int32 or null as pigemm_s8_scaled's -> y [M, I] = silu(g) * u,
// where g and u are what pigemm_s8_scaled would store (T: bf16 where out_bf16, else float32)
// and the SiLU and the product round as elementwise.cpp's silu_and_mul does: bit for bit the
// unfused path, without its [M, 2I] intermediate. 1: I % 64 != 0, other shapes not supported,
// no AVX512-VNNI, or bf16 without AVX512-BF16 in this build (elementwise.cpp's bf16 SiLU there
// is a scalar loop of its own).
int pigemm_s8_silu_mul(void* y, const int8_t* x, int64_t ldx, const int8_t* packed,
                       const float* scale, const float* token_scale, const int32_t* bias,
                       int out_bf16, int64_t M, int64_t I, int64_t K) {
#if defined(QS_PIGEMM)
#if !defined(__AVX512BF16__)
  if (out_bf16) return 1;
#endif
  if (M <= 0 || I <= 0 || I % PANEL != 0 || K <= 0 || K >= (int64_t{1} << 16) || ldx < K)
    return 1;
  run<kSiluMul>(y, x, ldx, packed, scale, token_scale, bias, nullptr, out_bf16 != 0, M, I, K);
  return 0;
#else
  (void)y, (void)x, (void)ldx, (void)packed, (void)scale, (void)token_scale, (void)bias,
      (void)out_bf16, (void)M, (void)I, (void)K;
  return 1;
#endif
}

}  // extern "C"
