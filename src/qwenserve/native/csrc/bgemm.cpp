// A bf16 GEMM on Intel AMX tiles for decode-sized batches, reading the model's plain [N, K]
// weight in place:
//
//   y[m, n] = round_bf16(bias[n] + sum_k x[m, k] * w[n, k])      (sums in fp32)
//
// At a few rows of x a GEMM streams every weight byte from memory once for few products, so its
// speed is the weight stream's. oneDNN's bf16 kernels on their packed weights streamed 12-16 GB/s
// at 1-32 rows on a 2-core Xeon where this kernel streams 16-19 (docs/benchmarks.md, "bf16
// decode GEMMs on AMX tiles"). The weight is the tiles' A operand straight from its rows (16
// weight rows x 32 k a tile, rows K apart: no packed copy), x is packed once per call into B tiles
// (16 rows of x x 32 k, k pairs as tile rows: a 16 x 16 transpose of 32-bit words), and the sums
// of 32 weight rows x 32 rows of x stay in four C tiles over all of K. Each further 32 rows of x
// are another pass over the same 32-row panel, read from L2; the tiles' products then bound the
// kernel (the caller routes only decode-sized batches here). The weight streams from memory
// through software prefetches: each pass brings its share of the next panel's rows into L2, and
// the first pass over a panel its own rows a step ahead into L1. A 24-layer stack's GEMMs, in %
// of the read bandwidth without / with them: 8 rows of x 86-91 / 91-98, 32 rows 75 / 88-90, 64
// rows 56-57 / 67-69 (the hardware prefetcher alone follows one stream per weight row;
// docs/benchmarks.md). Threads split the weight's 32-row panels; x is packed by all of them
// before any starts (one barrier).
//
// Needs K % 32 == 0 and N % 32 == 0: returns 1 for other shapes and 2 where the build or the
// process has no AMX (the caller keeps its other GEMM).
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include <omp.h>

#include "amx_tiles.h"

namespace {

#if defined(QS_AMX)
using qs_amx::TILE;
using qs_amx::transpose16;

constexpr int64_t PANEL = 32;  // weight rows a task: two A tiles

// Packed x: grows with the largest call, kept by the calling thread (its team shares it).
struct Buffer {
  uint16_t* data = nullptr;
  int64_t size = 0;
  uint16_t* get(int64_t n) {
    if (n > size) {
      std::free(data);
      data = static_cast<uint16_t*>(std::aligned_alloc(64, (n * 2 + 63) / 64 * 64));
      size = data ? n : 0;
    }
    return data;
  }
  ~Buffer() { std::free(data); }
};

// Rows m0 .. m0+15 of x, k 32s .. 32s+31 -> one B tile (k pairs as rows, a row of x per 32-bit
// column); rows past M are zero.
inline void pack_tile(uint16_t* dst, const uint16_t* x, int64_t ldx, int64_t m0, int64_t M,
                      int64_t s) {
  __m512 rows[16], cols[16];
  for (int64_t i = 0; i < 16; ++i)
    rows[i] = m0 + i < M ? _mm512_loadu_ps(x + (m0 + i) * ldx + 32 * s) : _mm512_setzero_ps();
  transpose16(rows, cols);
  float* tile = reinterpret_cast<float*>(dst);
  for (int r = 0; r < 16; ++r) _mm512_store_ps(tile + 16 * r, cols[r]);
}

// A C tile (16 weight rows x 16 rows of x, fp32) -> y[m0 + i][n0 .. n0+15] + bias, rounded to
// bf16 (rows past M are not written).
inline void store_tile(const float* c, uint16_t* y, int64_t N, int64_t m0, int64_t M, int64_t n0,
                       const uint16_t* bias) {
  __m512 rows[16], cols[16];
  for (int r = 0; r < 16; ++r) rows[r] = _mm512_load_ps(c + 16 * r);
  transpose16(rows, cols);
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(bias + n0))), 16))
                        : _mm512_setzero_ps();
  const int64_t rows_x = std::min<int64_t>(16, M - m0);
  for (int64_t i = 0; i < rows_x; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + i) * N + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(cols[i], b)));
}

// What a pass over a panel prefetches: rows row0 .. row0+rows-1 of the next panel (into L2, one
// line a row each step; null: none), and, on the panel's first pass, its own rows a step ahead
// (into L1: they are in L2 by then, from the previous panel's passes).
struct Prefetch {
  const char* next = nullptr;
  int64_t row0 = 0, rows = 0;
  bool ahead = false;
};

// Weight rows n0 .. n0+31 against x's 16-row blocks xb and xb + 1 (TWO) or xb alone, over all
// of K.
template <bool TWO>
void panel(const uint16_t* w, const uint16_t* xp, uint16_t* y, const uint16_t* bias, int64_t M,
           int64_t N, int64_t K, int64_t n0, int64_t xb, float* c, const Prefetch& pf) {
  const int64_t steps = K / 32, ldw = K * 2;
  const uint16_t* a0 = w + n0 * K;
  const uint16_t* a1 = a0 + 16 * K;
  const uint16_t* b0 = xp + xb * steps * TILE;
  const uint16_t* b1 = b0 + steps * TILE;
  const char* own = reinterpret_cast<const char*>(a0);
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (TWO) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (pf.next != nullptr)
      for (int64_t r = pf.row0; r < pf.row0 + pf.rows; ++r)
        _mm_prefetch(pf.next + r * ldw + 64 * s, _MM_HINT_T2);
    if (pf.ahead && s + 1 < steps)
      for (int64_t r = 0; r < PANEL; ++r) _mm_prefetch(own + r * ldw + 64 * (s + 1), _MM_HINT_T0);
    _tile_loadd(0, a0 + 32 * s, ldw);
    _tile_loadd(1, a1 + 32 * s, ldw);
    _tile_loadd(2, b0 + s * TILE, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
    if constexpr (TWO) {
      _tile_loadd(3, b1 + s * TILE, 64);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  store_tile(c, y, N, 16 * xb, M, n0, bias);
  store_tile(c + 256, y, N, 16 * xb, M, n0 + 16, bias);
  if constexpr (TWO) {
    _tile_stored(6, c, 64);
    _tile_stored(7, c + 256, 64);
    store_tile(c, y, N, 16 * (xb + 1), M, n0, bias);
    store_tile(c + 256, y, N, 16 * (xb + 1), M, n0 + 16, bias);
  }
}
#endif  // QS_AMX

}  // namespace

extern "C" {

// 1 where this build and process run the AMX kernel, else 0 (bgemm_bf16 would return 2).
int bgemm_bf16_available() {
#if defined(QS_AMX)
  return qs_amx::permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// x [M, K] bf16 with row stride ldx (>= K), w [N, K] bf16 contiguous, bias [N] bf16 or null,
// y [M, N] bf16 contiguous. Returns 0; 1 for a shape it does not take (empty, K or N not a
// multiple of 32); 2 without AMX; 3 when the packing buffer cannot be allocated.
int bgemm_bf16(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t M,
               int64_t N, int64_t K, int64_t ldx) {
  if (M <= 0 || N <= 0 || K <= 0 || ldx < K || K % 32 != 0 || N % 32 != 0) return 1;
#if !defined(QS_AMX)
  (void)y, (void)x, (void)w, (void)bias;
  return 2;
#else
  if (!qs_amx::permitted()) return 2;
  static thread_local Buffer buffer;
  const int64_t blocks = (M + 15) / 16, steps = K / 32, panels = N / PANEL;
  uint16_t* xp = buffer.get(blocks * steps * TILE);
  if (xp == nullptr) return 3;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t j = tid; j < blocks * steps; j += threads)
      pack_tile(xp + j * TILE, x, ldx, 16 * (j / steps), M, j % steps);
    qs_amx::configure();
    alignas(64) float c[512];
    const int64_t per = panels / threads, extra = panels % threads;
    const int64_t p0 = tid * per + std::min(tid, extra), p1 = p0 + per + (tid < extra ? 1 : 0);
#pragma omp barrier
    const int64_t passes = (blocks + 1) / 2;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t xb = 0; xb < blocks; xb += 2) {
        // the next panel's rows spread over this panel's passes
        const int64_t pass = xb / 2, row0 = PANEL * pass / passes;
        const Prefetch pf{p + 1 < p1 ? reinterpret_cast<const char*>(w + PANEL * (p + 1) * K)
                                     : nullptr,
                          row0, PANEL * (pass + 1) / passes - row0, pass == 0};
        if (xb + 1 < blocks)
          panel<true>(w, xp, y, bias, M, N, K, PANEL * p, xb, c, pf);
        else
          panel<false>(w, xp, y, bias, M, N, K, PANEL * p, xb, c, pf);
      }
    _tile_release();
  }
  return 0;
#endif
}

}  // extern "C"
