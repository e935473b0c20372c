// W8A8's GEMM on Intel AMX-INT8 tiles for decode-sized batches, reading the model's plain
// [N, K] int8 weight in place, with the W8A8 scaling in the epilogue:
//
//   y[m, n] = T(T32(T32(float(sum_k x[m, k] * w[n, k] + bias[n]) * scale[n]) * token_scale[m]))
//             (+ out_bias[n], rounded again, as a layer's float bias is added to y)
//
// with bias [N] int32, token_scale [M] and out_bias [N] optional: the values of
// platforms/base.py's int32_epilogue on exact int32 sums (the same fp32 products in the same
// order), as native/csrc/gemv.cpp's gemv_s8_scaled gives for 1-2 rows. oneDNN's packed int8 GEMM
// streamed ~12 GB/s at 64 rows on an Emerald Rapids Xeon (40 ms of a 52 ms W8A8 decode step of
// the Qwen2.5-0.5B shape), where bf16's AMX GEMM (bgemm.cpp) streams ~26 GB/s.
//
// The layout is bgemm.cpp's at one byte an element: 16 weight rows x 64 k a tile (the A operand,
// straight from the weight's rows), x packed once per call into B tiles (16 rows of x x 64 k, k
// quads as tile rows: a 16 x 16 transpose of 32-bit words, as for bf16's pairs), the int32 sums of
// 32 weight rows x 32 rows of x in four C tiles over all of K. Threads split the weight's 32-row
// panels; each pass over a panel brings the next panel's rows into L2 (one line a row a step).
//
// Needs K % 64 == 0 and N % 32 == 0: returns 1 for other shapes, 2 where the build or the
// process has no AMX-INT8, 3 when the packing buffer cannot be allocated.
#include <algorithm>
#include <cstdint>

#include <omp.h>

#include "amx_tiles.h"

namespace {

#if defined(QS_AMX) && defined(__AMX_INT8__)
#define QS_AMX_INT8 1
using qs_amx::transpose16;

constexpr int64_t PANEL = 32;      // weight rows a task: two A tiles
constexpr int64_t TILE_BYTES = 1024;  // a 16 x 64-byte tile

struct Scaling {
  const float* scale;        // [N]
  const float* token_scale;  // [M] or null
  const int32_t* bias;       // [N] or null (int32, added to the sums)
  const void* out_bias;      // [N] in y's dtype, or null
  bool out_bf16;
};

// A C tile (16 weight rows n0.. x 16 rows of x m0.., int32) -> y, scaled (rows past M unwritten).
inline void store_tile(const int32_t* c, void* y, int64_t N, int64_t m0, int64_t M, int64_t n0,
                       const Scaling& sc) {
  __m512 rows[16], cols[16];
  for (int r = 0; r < 16; ++r)
    rows[r] = _mm512_load_ps(reinterpret_cast<const float*>(c) + 16 * r);
  transpose16(rows, cols);  // cols[i]: row m0 + i of x, 16 outputs n0 .. n0+15 (int32 bits)
  const __m512i bias = sc.bias ? _mm512_loadu_si512(sc.bias + n0) : _mm512_setzero_si512();
  const __m512 scale = _mm512_loadu_ps(sc.scale + n0);
  const int64_t rows_x = std::min<int64_t>(16, M - m0);
  for (int64_t i = 0; i < rows_x; ++i) {
    const __m512i sum = _mm512_add_epi32(_mm512_castps_si512(cols[i]), bias);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale);
    if (sc.token_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(sc.token_scale[m0 + i]));
    const int64_t at = (m0 + i) * N + n0;
    if (sc.out_bf16) {
      __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
      if (sc.out_bias) {  // y rounds first, then y + bias rounds again, as in PyTorch
        const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            static_cast<const uint16_t*>(sc.out_bias) + n0));
        const __m512 bf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
        const __m512 yf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
        out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(yf, bf));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + at), out);
    } else {
      if (sc.out_bias)
        v = _mm512_add_ps(v, _mm512_loadu_ps(static_cast<const float*>(sc.out_bias) + n0));
      _mm512_storeu_ps(static_cast<float*>(y) + at, v);
    }
  }
}

// A panel's 32 weight rows (w0: its first) against x's 16-row blocks xb and xb + 1 (TWO) or xb
// alone, over all of K; next: the next panel's first row (null: none) and which of its rows
// this pass prefetches into L2.
template <bool TWO>
void panel(const int8_t* w0, const int8_t* xp, void* y, int64_t M, int64_t N, int64_t K,
           int64_t n0, int64_t xb, int32_t* c, const int8_t* next, int64_t row0, int64_t rows,
           const Scaling& sc) {
  const int64_t steps = K / 64;
  const int8_t* b0 = xp + xb * steps * TILE_BYTES;
  const int8_t* b1 = b0 + steps * TILE_BYTES;
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (TWO) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (next != nullptr)
      for (int64_t r = row0; r < row0 + rows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * K + 64 * s), _MM_HINT_T2);
    _tile_loadd(0, w0 + 64 * s, K);
    _tile_loadd(1, w0 + 16 * K + 64 * s, K);
    _tile_loadd(2, b0 + s * TILE_BYTES, 64);
    _tile_dpbssd(4, 0, 2);
    _tile_dpbssd(5, 1, 2);
    if constexpr (TWO) {
      _tile_loadd(3, b1 + s * TILE_BYTES, 64);
      _tile_dpbssd(6, 0, 3);
      _tile_dpbssd(7, 1, 3);
    }
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  store_tile(c, y, N, 16 * xb, M, n0, sc);
  store_tile(c + 256, y, N, 16 * xb, M, n0 + 16, sc);
  if constexpr (TWO) {
    _tile_stored(6, c, 64);
    _tile_stored(7, c + 256, 64);
    store_tile(c, y, N, 16 * (xb + 1), M, n0, sc);
    store_tile(c + 256, y, N, 16 * (xb + 1), M, n0 + 16, sc);
  }
}
#endif  // QS_AMX && __AMX_INT8__

}  // namespace

extern "C" {

// 1 where this build and process run the AMX-INT8 kernel, else 0.
int igemm_s8_available() {
#if defined(QS_AMX_INT8)
  return qs_amx::permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// x [M, K] int8 with row stride ldx (>= K), w [N, K] int8 contiguous, scale [N] float32,
// token_scale [M] float32 or null, bias [N] int32 or null, out_bias [N] (y's dtype) or null;
// y [M, N] float32 (out_bf16 0) or bf16, contiguous. See the top of the file.
int igemm_s8_scaled(void* y, const int8_t* x, const int8_t* w, const float* scale,
                    const float* token_scale, const int32_t* bias, const void* out_bias,
                    int64_t M, int64_t N, int64_t K, int64_t ldx, int out_bf16) {
  if (M <= 0 || N <= 0 || K <= 0 || ldx < K || K % 64 != 0 || N % 32 != 0) return 1;
#if !defined(QS_AMX_INT8)
  (void)y, (void)x, (void)w, (void)scale, (void)token_scale, (void)bias, (void)out_bias;
  (void)out_bf16;
  return 2;
#else
  if (!qs_amx::permitted()) return 2;
  static thread_local qs_amx::Buffer<int8_t> buffer;
  const int64_t blocks = (M + 15) / 16, steps = K / 64, panels = N / PANEL;
  int8_t* xp = buffer.get(blocks * steps * TILE_BYTES);
  if (xp == nullptr) return 3;
  const Scaling sc{scale, token_scale, bias, out_bias, out_bf16 != 0};
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t j = tid; j < blocks * steps; j += threads)
      qs_amx::pack_b_tile(xp + j * TILE_BYTES, x, ldx, 16 * (j / steps), M, j % steps);
    qs_amx::configure();
    alignas(64) int32_t c[512];
    const int64_t per = panels / threads, extra = panels % threads;
    const int64_t p0 = tid * per + std::min(tid, extra), p1 = p0 + per + (tid < extra ? 1 : 0);
#pragma omp barrier
    const int64_t passes = (blocks + 1) / 2;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t xb = 0; xb < blocks; xb += 2) {
        const int64_t pass = xb / 2, row0 = PANEL * pass / passes;
        const int8_t* next = p + 1 < p1 ? w + PANEL * (p + 1) * K : nullptr;
        const int64_t rows = PANEL * (pass + 1) / passes - row0;
        if (xb + 1 < blocks)
          panel<true>(w + PANEL * p * K, xp, y, M, N, K, PANEL * p, xb, c, next, row0, rows, sc);
        else
          panel<false>(w + PANEL * p * K, xp, y, M, N, K, PANEL * p, xb, c, next, row0, rows, sc);
      }
    _tile_release();
  }
  return 0;
#endif
}

}  // extern "C"
