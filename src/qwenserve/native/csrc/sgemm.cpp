// A cache-blocked float32 GEMM against a row-major weight [N, K], for prefill and batched decode:
//
//   y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]
//
// BLIS's loop structure with the operands' roles swapped, so the weight is read where the model
// keeps it (no repacked copy: weight accounting, tied embeddings and sharded saving see one
// tensor). W plays BLIS's "A": a micro-tile takes MR = 6 rows of W (6 output columns) and, at
// each k, broadcasts W[n0 + i][k] straight from those rows (6 sequential streams). x plays "B":
// it is packed once per call (it is small next to the weight) into k-major panels of NR = 16 rows,
// so one k step loads 16 x values as two vectors. 12 accumulators + 2 x vectors + 1 broadcast fill
// 15 of the 16 AVX2 registers; 12 FMAs per step against 8 loads, in the 2-FMA/2-load per cycle
// budget of Zen 2 / Skylake. Built for AVX512, the same loops run 16-lane vectors: MR = 8 weight
// rows against NR = 32 rows of x, 16 accumulators (batched decode: 1.06-1.43x oneDNN's packed
// kernels at 16-64 rows on a Sapphire Rapids Xeon), and a last panel of at most 16 rows
// multiplies only its first vector. Each tile is written back transposed (C[m, n0..n0+MR)) once
// per KC block, which amortises the scalar stores over KC k steps.
//
// Blocking: K in blocks of at most KC_MAX (an MR x KC weight panel stays in L1 while it meets
// every x panel of an MC-row block, from L2/L3); threads split the weight's row panels, and each
// packs the x block it works on itself (no barrier: one parallel region per call, one join).
// While a panel's first tile runs, the next panel's weight rows are prefetched: at 16-64 rows of
// x that hid most of the weight's memory latency (1.1-1.2x), and the hardware prefetcher alone
// did not. KC 1024 and MC 512 measured best of 256-1024 / 64-512 on the model's shapes (AVX2
// EPYC; on the AVX512 Xeon KC 256 and 448 were slower too, 1.1-1.35x at 256-512 rows).
// Edge tiles: a short weight panel repeats its last row (results not stored); a short x panel is
// zero-padded in the pack. Built with -march=native; without AVX2+FMA the entry point returns 2
// and the caller keeps its other GEMM.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <omp.h>

namespace {

#if defined(__AVX512F__)
// 8 x 32: 16 accumulators of 16 lanes. 6 x 32 (12) ran 4% and 12 x 32 (24) 5% slower over the
// model's shapes at 64 rows (Sapphire Rapids Xeon, docs/benchmarks.md).
constexpr int64_t MR = 8;         // weight rows per micro-tile
constexpr int64_t NR = 32;        // x rows per micro-tile (two 16-float vectors)
#else
constexpr int64_t MR = 6;         // weight rows per micro-tile
constexpr int64_t NR = 16;        // x rows per micro-tile (two 8-float vectors)
#endif
constexpr int64_t KC_MAX = 1024;  // k per block: MR x 1024 floats of W (24 / 32 KB) in L1
constexpr int64_t MC = 512;       // x rows per block: each weight panel is read M / MC times

// K split into equal blocks of at most KC_MAX, each a multiple of 8 where K allows.
inline int64_t k_block(int64_t K) {
  const int64_t blocks = (K + KC_MAX - 1) / KC_MAX;
  const int64_t kc = (K + blocks - 1) / blocks;
  return std::min(K, (kc + 7) / 8 * 8);
}

#if defined(__AVX2__) && defined(__FMA__)

// 8 rows x 8 columns of x (row stride ldx) -> 8 k-major vectors at xp, xp + NR, ...
inline void transpose8(float* xp, const float* x, int64_t ldx) {
  __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ldx);
  __m256 r2 = _mm256_loadu_ps(x + 2 * ldx), r3 = _mm256_loadu_ps(x + 3 * ldx);
  __m256 r4 = _mm256_loadu_ps(x + 4 * ldx), r5 = _mm256_loadu_ps(x + 5 * ldx);
  __m256 r6 = _mm256_loadu_ps(x + 6 * ldx), r7 = _mm256_loadu_ps(x + 7 * ldx);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  r0 = _mm256_shuffle_ps(t0, t2, 0x44), r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  r2 = _mm256_shuffle_ps(t1, t3, 0x44), r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  r4 = _mm256_shuffle_ps(t4, t6, 0x44), r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  r6 = _mm256_shuffle_ps(t5, t7, 0x44), r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_store_ps(xp + 0 * NR, _mm256_permute2f128_ps(r0, r4, 0x20));
  _mm256_store_ps(xp + 1 * NR, _mm256_permute2f128_ps(r1, r5, 0x20));
  _mm256_store_ps(xp + 2 * NR, _mm256_permute2f128_ps(r2, r6, 0x20));
  _mm256_store_ps(xp + 3 * NR, _mm256_permute2f128_ps(r3, r7, 0x20));
  _mm256_store_ps(xp + 4 * NR, _mm256_permute2f128_ps(r0, r4, 0x31));
  _mm256_store_ps(xp + 5 * NR, _mm256_permute2f128_ps(r1, r5, 0x31));
  _mm256_store_ps(xp + 6 * NR, _mm256_permute2f128_ps(r2, r6, 0x31));
  _mm256_store_ps(xp + 7 * NR, _mm256_permute2f128_ps(r3, r7, 0x31));
}

// Pack rows [p * NR, p * NR + NR) of x into xp[k][0..NR) for k in [0, K), zero past M.
inline void pack_panel(float* xp, const float* x, int64_t ldx, int64_t p, int64_t M, int64_t K) {
  const int64_t m0 = p * NR, rows = std::min(NR, M - m0);
  int64_t k = 0;
  if (rows == NR) {  // full panels: 8 x 8 blocks through registers
    for (; k + 8 <= K; k += 8)
      for (int64_t r = 0; r < NR; r += 8) transpose8(xp + k * NR + r, x + (m0 + r) * ldx + k, ldx);
  } else {
    std::memset(xp, 0, sizeof(float) * NR * K);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + (m0 + r) * ldx;
    for (int64_t kk = k; kk < K; ++kk) xp[kk * NR + r] = src[kk];
  }
}

// The vector type of the micro-tile: 8 lanes (AVX2) or 16 (AVX512), NR = 2 vectors.
#if defined(__AVX512F__)
typedef __m512 Vec;
constexpr int64_t LANES = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_load_ps(p); }
inline Vec vsplat(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_store_ps(p, v); }
#else
typedef __m256 Vec;
constexpr int64_t LANES = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_load_ps(p); }
inline Vec vsplat(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_store_ps(p, v); }
#endif
static_assert(NR == 2 * LANES, "a micro-tile's x panel is two vectors wide");

// One MR x NR tile over kc steps: w[i] = &W[n0 + i][k0], xp = the panel's packed x at k0.
// Writes C[m0 + j][n0 + i] (j < rows_m, i < rows_n): = acc (+ bias) on the first K block,
// += acc on later ones. HALF: the panel has at most LANES rows (a short last panel), so only
// its first vector is multiplied.
template <bool PREFETCH, bool HALF>
inline void tile(const float* const w[MR], const float* xp, int64_t kc, float* c, int64_t ldc,
                 int64_t rows_n, int64_t rows_m, const float* bias, bool first,
                 const float* const next[MR]) {
  constexpr int NV = HALF ? 1 : 2;
  Vec acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t k = 0; k < kc; ++k, xp += NR) {
    if (PREFETCH && (k & 15) == 0) {
#pragma GCC unroll 16
      for (int64_t i = 0; i < MR; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(next[i] + k), _MM_HINT_T0);
    }
    Vec xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = vload(xp + v * LANES);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const Vec b = vsplat(w[i][k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(b, xv[v], acc[i][v]);
    }
  }
  alignas(64) float t[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) vstore(t[i] + v * LANES, acc[i][v]);
  for (int64_t j = 0; j < rows_m; ++j) {
    float* cr = c + j * ldc;
    if (first) {
      for (int64_t i = 0; i < rows_n; ++i) cr[i] = t[i][j] + (bias ? bias[i] : 0.f);
    } else {
      for (int64_t i = 0; i < rows_n; ++i) cr[i] += t[i][j];
    }
  }
}

#endif

struct Buffer {  // one thread's packed x block, kept between calls (grown, never shrunk)
  float* data = nullptr;
  int64_t size = 0;
  ~Buffer() { std::free(data); }
  float* get(int64_t n) {
    if (n > size) {
      std::free(data);
      data = static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
      size = data ? n : 0;
    }
    return data;
  }
};

}  // namespace

extern "C" {

// 1 where this build has the AVX2 + FMA kernel, else 0 (sgemm_f32 would return 2).
int sgemm_f32_available() {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

// x [M, K] with row stride ldx (>= K), w [N, K] contiguous, bias [N] or null, y [M, N]
// contiguous. Returns 0; 1 for an empty or invalid shape; 2 where this build has no AVX2+FMA;
// 3 when the packing buffer cannot be allocated.
int sgemm_f32(float* y, const float* x, const float* w, const float* bias, int64_t M, int64_t N,
              int64_t K, int64_t ldx) {
  if (M <= 0 || N <= 0 || K <= 0 || ldx < K) return 1;
#if !(defined(__AVX2__) && defined(__FMA__))
  (void)y, (void)x, (void)w, (void)bias;
  return 2;
#else
  const int64_t panels_m = (M + NR - 1) / NR, panels_n = (N + MR - 1) / MR;
  const int64_t kc_max = k_block(K);
  const int64_t panels_mc = MC / NR;
  int status = 0;
#pragma omp parallel
  {
    // Each thread packs the x block it works on into its own buffer (cores have private L2s,
    // so a shared copy would be copied into each anyway): no barrier inside the region.
    static thread_local Buffer buffer;
    float* xp = buffer.get(std::min(panels_m, panels_mc) * NR * kc_max);
    const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t per = panels_n / threads, extra = panels_n % threads;
    const int64_t pn0 = tid * per + std::min(tid, extra);
    const int64_t pn1 = pn0 + per + (tid < extra ? 1 : 0);
    if (xp == nullptr) {
#pragma omp atomic write
      status = 3;
    }
    for (int64_t k0 = 0; xp != nullptr && pn0 < pn1 && k0 < K; k0 += kc_max) {
      const int64_t kc = std::min(kc_max, K - k0);
      const bool first = k0 == 0;
      for (int64_t pm0 = 0; pm0 < panels_m; pm0 += panels_mc) {
        const int64_t pm1 = std::min(panels_m, pm0 + panels_mc);
        for (int64_t pm = pm0; pm < pm1; ++pm)
          pack_panel(xp + (pm - pm0) * NR * kc, x + k0, ldx, pm, M, kc);
        for (int64_t pn = pn0; pn < pn1; ++pn) {
          const int64_t n0 = pn * MR, rows_n = std::min(MR, N - n0);
          const float* wr[MR];
          for (int64_t i = 0; i < MR; ++i) wr[i] = w + (n0 + std::min(i, rows_n - 1)) * K + k0;
          const float* b = bias ? bias + n0 : nullptr;
          // the next panel's weight rows start coming in during this panel's first tile
          const float* next[MR];
          for (int64_t i = 0; i < MR; ++i) next[i] = w + std::min(n0 + MR + i, N - 1) * K + k0;
          for (int64_t pm = pm0; pm < pm1; ++pm) {
            const int64_t m0 = pm * NR, rows_m = std::min(NR, M - m0);
            const float* xpm = xp + (pm - pm0) * NR * kc;
            float* c = y + m0 * N + n0;
            const bool lead = pm == pm0, half = rows_m <= LANES;
            if (lead && half)
              tile<true, true>(wr, xpm, kc, c, N, rows_n, rows_m, b, first, next);
            else if (lead)
              tile<true, false>(wr, xpm, kc, c, N, rows_n, rows_m, b, first, next);
            else if (half)
              tile<false, true>(wr, xpm, kc, c, N, rows_n, rows_m, b, first, next);
            else
              tile<false, false>(wr, xpm, kc, c, N, rows_n, rows_m, b, first, next);
          }
        }
      }
    }
  }
  return status;
#endif
}

}  // extern "C"
