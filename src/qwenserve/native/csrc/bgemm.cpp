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
//
// bgemm_bf16_silu_mul is an MLP's gate_up projection with its SiLU-and-mul in the epilogue:
// a task's 32 weight rows are 16 gate rows and their 16 up rows, and the C tiles leave as
// silu(gate) * up, rounded where the unfused path rounds (gate and up to bf16, silu(gate) to
// bf16, the product to bf16), so the result is that path's bit for bit, without the [M, 2I]
// intermediate and the separate pass over it.
//
// bgemm_bf16_argmax is an LM head's GEMM with a greedy sampler's argmax in the epilogue: each
// row of x leaves the first column of its largest logit, the logits being the GEMM's (rounded to
// bf16, bias included), so the token is the one the GEMM followed by argmax gives, without
// writing the [M, N] logits and reading them back (64 rows of a 152k vocabulary: 19.5 MB a
// decode step each way).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <omp.h>

#include "amx_tiles.h"
#include "vec_math.h"

namespace {

#if defined(QS_AMX)
using qs_amx::TILE;
using qs_amx::transpose16;

constexpr int64_t PANEL = 32;  // weight rows a task: two A tiles

// A C tile (16 weight rows x 16 rows of x, fp32) as 16 vectors, one a row of x, plus bias[0 ..
// 15] (null: none).
inline void tile_rows(const float* c, const uint16_t* bias, __m512* cols) {
  __m512 rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = _mm512_load_ps(c + 16 * r);
  transpose16(rows, cols);
  if (bias == nullptr) return;
  const __m512 b = load_bf16(bias, 0xFFFF);
  for (int i = 0; i < 16; ++i) cols[i] = _mm512_add_ps(cols[i], b);
}

// A C tile -> y[m0 + i][n0 .. n0+15] (+ bias), rounded to bf16 (rows past M are not written).
inline void store_tile(const float* c, uint16_t* y, int64_t N, int64_t m0, int64_t M, int64_t n0,
                       const uint16_t* bias) {
  __m512 cols[16];
  tile_rows(c, bias ? bias + n0 : nullptr, cols);
  const int64_t rows_x = std::min<int64_t>(16, M - m0);
  for (int64_t i = 0; i < rows_x; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + i) * N + n0),
                        (__m256i)_mm512_cvtneps_pbh(cols[i]));
}

// A gate C tile and its up C tile -> y[m0 + i][n0 .. n0+15] = silu(gate) * up, with
// elementwise.cpp's roundings (gate and up as the bf16 values the GEMM would have stored, silu
// rounded to bf16, the product rounded once): y has I columns; bias [2I] or null. A full block
// of x is computed in the tiles' layout (a row a feature: all 16 lanes are rows of x) and
// transposed once, for the store; a block of a few rows is transposed first, so that the SiLU
// runs on those rows only (in the tiles' layout it ran on 16 lanes for them: 2 rows of x 3%
// slower than the unfused path, docs/benchmarks.md).
inline void store_silu_mul_tile(const float* gate, const float* up, uint16_t* y, int64_t I,
                                int64_t m0, int64_t M, int64_t n0, const uint16_t* bias) {
  const int64_t rows_x = std::min<int64_t>(16, M - m0);
  const uint16_t* table = silu_bf16_table();
  __m512 h[16], cols[16];
  if (rows_x <= 8) {
    __m512 g[16];
    tile_rows(gate, bias ? bias + n0 : nullptr, g);
    tile_rows(up, bias ? bias + I + n0 : nullptr, cols);
    for (int64_t i = 0; i < rows_x; ++i)
      cols[i] = _mm512_mul_ps(silu_bf16(table, g[i]), bf16_round(cols[i]));
  } else {
    for (int r = 0; r < 16; ++r) {
      __m512 g = _mm512_load_ps(gate + 16 * r), u = _mm512_load_ps(up + 16 * r);
      if (bias != nullptr) {
        g = _mm512_add_ps(g, _mm512_set1_ps(to_float(bias[n0 + r])));
        u = _mm512_add_ps(u, _mm512_set1_ps(to_float(bias[I + n0 + r])));
      }
      h[r] = _mm512_mul_ps(silu_bf16(table, g), bf16_round(u));
    }
    transpose16(h, cols);
  }
  for (int64_t i = 0; i < rows_x; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + i) * I + n0),
                        (__m256i)_mm512_cvtneps_pbh(cols[i]));
}

// A task's 32 weight rows: rows 0-15 from lo, rows 16-31 from hi, each row K values after the
// last (the GEMM's are 32 consecutive rows; the fused gate_up's 16 gate rows and their up rows).
struct Rows {
  const uint16_t* lo = nullptr;
  const uint16_t* hi = nullptr;
};

// Panel p of a plain [N, K] weight: its 32 consecutive rows.
inline Rows consecutive_panel(const uint16_t* w, int64_t K, int64_t p) {
  return Rows{w + PANEL * p * K, w + (PANEL * p + 16) * K};
}

// Prefetches line `offset` (bytes) of rows r0 .. r1-1 of g. The GEMM's 32 rows are consecutive
// (hi = lo + 16 rows): one pointer stepping by the row stride, as tight as the loop can be (it
// is ~17% of the kernel's samples at 64 rows of x); the fused gate_up's groups are apart, and a
// branch to hi at row 16 costs the loop a little (a loop per group, which the compiler unrolled
// in full, or a per-row choice of group cost the 64-row GEMM 8-13%).
template <_mm_hint HINT, bool CONSECUTIVE>
inline void prefetch_rows(const Rows& g, int64_t r0, int64_t r1, int64_t ldw, int64_t offset) {
  const char* lo = reinterpret_cast<const char*>(g.lo) + offset;
  if constexpr (CONSECUTIVE) {
    for (int64_t r = r0; r < r1; ++r) _mm_prefetch(lo + r * ldw, HINT);
  } else {
    const char* hi = reinterpret_cast<const char*>(g.hi) + offset;
    const char* p = r0 < 16 ? lo + r0 * ldw : hi + (r0 - 16) * ldw;
    for (int64_t r = r0; r < r1; ++r, p += ldw) {
      if (r == 16) p = hi;
      _mm_prefetch(p, HINT);
    }
  }
}

// What a pass over a panel prefetches: rows row0 .. row0+rows-1 of the next panel (into L2, one
// line a row each step; next.lo null: none), and, on the panel's first pass, its own rows a step
// ahead (into L1: they are in L2 by then, from the previous panel's passes).
struct Prefetch {
  Rows next;
  int64_t row0 = 0, rows = 0;
  bool ahead = false;
};

// How a panel's C tiles leave: rounded to bf16 (the GEMM), as silu(gate) * up, or into each row
// of x's running argmax.
enum class Epilogue { kStore, kSiluMul, kArgmax };

// A thread's running argmax, 16 lanes (rows of x) a block of x: the largest bf16-rounded logit
// seen and its column. Columns reach a thread in increasing order, so a strict comparison keeps
// the first of equal maxima; NaN never compares larger (a row of NaN and -inf leaves column 0).
struct Argmax {
  float* best = nullptr;
  int32_t* column = nullptr;
};

// C tile (16 weight rows = columns n0 .. n0+15 of the logits, 16 rows of x) into block xb's
// running argmax.
inline void argmax_tile(const float* c, const uint16_t* bias, int64_t n0, const Argmax& am,
                        int64_t xb) {
  __m512 best = _mm512_loadu_ps(am.best + 16 * xb);
  __m512i column = _mm512_loadu_si512(am.column + 16 * xb);
  for (int r = 0; r < 16; ++r) {
    __m512 v = _mm512_load_ps(c + 16 * r);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_set1_ps(to_float(bias[n0 + r])));
    v = bf16_round(v);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, larger, v);
    column = _mm512_mask_mov_epi32(column, larger, _mm512_set1_epi32(int32_t(n0 + r)));
  }
  _mm512_storeu_ps(am.best + 16 * xb, best);
  _mm512_storeu_si512(am.column + 16 * xb, column);
}

// A panel's 32 weight rows (a) against x's 16-row blocks xb and xb + 1 (TWO) or xb alone, over
// all of K; its outputs are columns n0 .. n0+31 of y (kStore) or of the argmax (kArgmax, into
// am), or n0 .. n0+15 of y (kSiluMul).
template <bool TWO, Epilogue E>
void panel(const Rows& a, const uint16_t* xp, uint16_t* y, const uint16_t* bias, int64_t M,
           int64_t N, int64_t K, int64_t n0, int64_t xb, float* c, const Prefetch& pf,
           const Argmax& am) {
  const int64_t steps = K / 32, ldw = K * 2;
  const uint16_t* a0 = a.lo;
  const uint16_t* a1 = a.hi;
  const uint16_t* b0 = xp + xb * steps * TILE;
  const uint16_t* b1 = b0 + steps * TILE;
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (TWO) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    constexpr bool consecutive = E == Epilogue::kStore;
    if (pf.next.lo != nullptr)
      prefetch_rows<_MM_HINT_T2, consecutive>(pf.next, pf.row0, pf.row0 + pf.rows, ldw, 64 * s);
    if (pf.ahead && s + 1 < steps)
      prefetch_rows<_MM_HINT_T0, consecutive>(a, 0, PANEL, ldw, 64 * (s + 1));
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
  auto leave = [&](int64_t m0) {
    if constexpr (E == Epilogue::kStore) {
      store_tile(c, y, N, m0, M, n0, bias);
      store_tile(c + 256, y, N, m0, M, n0 + 16, bias);
    } else if constexpr (E == Epilogue::kArgmax) {
      argmax_tile(c, bias, n0, am, m0 / 16);
      argmax_tile(c + 256, bias, n0 + 16, am, m0 / 16);
    } else {
      store_silu_mul_tile(c, c + 256, y, N, m0, M, n0, bias);
    }
  };
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  leave(16 * xb);
  if constexpr (TWO) {
    _tile_stored(6, c, 64);
    _tile_stored(7, c + 256, 64);
    leave(16 * (xb + 1));
  }
}

// y from x and the weight's panels (rows_of(p): panel p's 32 rows; its outputs start at column
// columns * p), split over the threads by panel; x is packed by all of them first. N is y's
// width. kArgmax: thread t's running argmax at argmax[t] (one per omp_get_max_threads(), each
// (M + 15) / 16 blocks of 16 lanes, set to -inf and column 0 by the caller). Returns 0, or 3
// when the packing buffer cannot be allocated.
template <Epilogue E, typename RowsOf>
int run(uint16_t* y, const uint16_t* x, const uint16_t* bias, int64_t M, int64_t N, int64_t K,
        int64_t ldx, int64_t panels, int64_t columns, RowsOf rows_of,
        const Argmax* argmax = nullptr) {
  static thread_local qs_amx::Buffer<uint16_t> buffer;
  const int64_t blocks = (M + 15) / 16, steps = K / 32;
  uint16_t* xp = buffer.get(blocks * steps * TILE);
  if (xp == nullptr) return 3;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t j = tid; j < blocks * steps; j += threads)
      qs_amx::pack_b_tile(xp + j * TILE, x, 2 * ldx, 16 * (j / steps), M, j % steps);
    qs_amx::configure();
    alignas(64) float c[512];
    const Argmax am = argmax == nullptr ? Argmax{} : argmax[tid];
    const int64_t per = panels / threads, extra = panels % threads;
    const int64_t p0 = tid * per + std::min(tid, extra), p1 = p0 + per + (tid < extra ? 1 : 0);
#pragma omp barrier
    const int64_t passes = (blocks + 1) / 2;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t xb = 0; xb < blocks; xb += 2) {
        // the next panel's rows spread over this panel's passes
        const int64_t pass = xb / 2, row0 = PANEL * pass / passes;
        const Prefetch pf{p + 1 < p1 ? rows_of(p + 1) : Rows{}, row0,
                          PANEL * (pass + 1) / passes - row0, pass == 0};
        if (xb + 1 < blocks)
          panel<true, E>(rows_of(p), xp, y, bias, M, N, K, columns * p, xb, c, pf, am);
        else
          panel<false, E>(rows_of(p), xp, y, bias, M, N, K, columns * p, xb, c, pf, am);
      }
    _tile_release();
  }
  return 0;
}
#endif  // QS_AMX

// Whether the entry points take this shape: a non-empty x read with row stride ldx >= K, K a
// multiple of the tiles' 32 and N of `n_multiple`.
inline bool takes(int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t n_multiple) {
  return M > 0 && N > 0 && K > 0 && ldx >= K && K % 32 == 0 && N % n_multiple == 0;
}

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
  if (!takes(M, N, K, ldx, 32)) return 1;
#if !defined(QS_AMX)
  (void)y, (void)x, (void)w, (void)bias;
  return 2;
#else
  if (!qs_amx::permitted()) return 2;
  return run<Epilogue::kStore>(y, x, bias, M, N, K, ldx, N / PANEL, PANEL,
                               [&](int64_t p) { return consecutive_panel(w, K, p); });
#endif
}

// An MLP's gate_up projection and SiLU-and-mul in one: w [2I, K] bf16 contiguous (I gate rows,
// then I up rows), bias [2I] or null, y [M, I] = silu(x w_gate^T + b_gate) * (x w_up^T + b_up)
// with the unfused path's roundings. Returns 0; 1 for a shape it does not take (empty, K not a
// multiple of 32, I not a multiple of 16); 2 without AMX; 3 out of memory.
int bgemm_bf16_silu_mul(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                        int64_t M, int64_t I, int64_t K, int64_t ldx) {
  if (!takes(M, I, K, ldx, 16)) return 1;
#if !defined(QS_AMX)
  (void)y, (void)x, (void)w, (void)bias;
  return 2;
#else
  if (!qs_amx::permitted()) return 2;
  return run<Epilogue::kSiluMul>(y, x, bias, M, I, K, ldx, I / 16, 16, [&](int64_t p) {
    return Rows{w + 16 * p * K, w + (I + 16 * p) * K};
  });
#endif
}

// tokens [M] int64: each row's argmax over the columns of round_bf16(x w^T + bias), the first of
// equal maxima (torch.argmax of bgemm_bf16's y; NaN logits are passed over). x, w, bias as
// bgemm_bf16's. Returns as bgemm_bf16.
int bgemm_bf16_argmax(int64_t* tokens, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                      int64_t M, int64_t N, int64_t K, int64_t ldx) {
  if (!takes(M, N, K, ldx, 32)) return 1;
#if !defined(QS_AMX)
  (void)tokens, (void)x, (void)w, (void)bias;
  return 2;
#else
  if (!qs_amx::permitted()) return 2;
  const int64_t lanes = 16 * ((M + 15) / 16), threads = omp_get_max_threads();
  std::vector<float> best(threads * lanes, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> column(threads * lanes, 0);
  std::vector<Argmax> per_thread(threads);
  for (int64_t t = 0; t < threads; ++t)
    per_thread[t] = Argmax{best.data() + t * lanes, column.data() + t * lanes};
  const int status = run<Epilogue::kArgmax>(
      nullptr, x, bias, M, N, K, ldx, N / PANEL, PANEL,
      [&](int64_t p) { return consecutive_panel(w, K, p); },
      per_thread.data());
  if (status != 0) return status;
  // threads hold increasing column ranges: a later one wins only with a larger maximum
  for (int64_t m = 0; m < M; ++m) {
    float top = best[m];
    int32_t at = column[m];
    for (int64_t t = 1; t < threads; ++t)
      if (best[t * lanes + m] > top) top = best[t * lanes + m], at = column[t * lanes + m];
    tokens[m] = at;
  }
  return 0;
#endif
}

}  // extern "C"
