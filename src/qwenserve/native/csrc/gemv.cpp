// Skinny GEMMs against a row-major weight [N, K], as decode runs them:
//
//   y[m, n] = sum_k x[m, k] * w[n, k]          float32; bf16 (fp32 sums); int8 x int8 -> int32
//
// At a few rows of x the product is bound by streaming W from memory; this loop reads W once, in
// the [N, K] layout the model keeps (no repacked copy): threads split the output rows in blocks
// of ROWS weight rows (independent loads overlap), and each block meets all M rows of x while it
// sits in L1/L2. Decode uses it for fp32 at 1-4 rows (from 8 the blocked GEMMs win), for bf16 at
// 1-2 (where the build has AVX512-BF16; the AMX kernel from 3), and for int8 at 1-2 rows, or any
// M on CPUs without VNNI, where oneDNN's int8 GEMM is 20x slower than fp32 (benchmarks.md, "GEMM
// routes"). Plain C++ (intrinsics for int8 and bf16) built at first use; called through ctypes.
#include <algorithm>
#include <cstdint>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

constexpr int64_t ROWS = 4;  // weight rows per block
// The bf16 kernel's: short rows (K = 896) spent a 4-row block's stream on its setup and
// reductions; 8 rows took a 24-layer stack of the Qwen2.5-0.5B shape's weights and its LM head
// 1.04x faster (37.0 -> 38.6 GB/s, alternating, Zen 5 EPYC; quartiles 1.02-1.07), before one
// row of x read the block row by row (dot_row_bf16).
constexpr int64_t BF16_ROWS = 8;

// Each thread streams its share of W block by block. At a few rows of x the hardware prefetcher
// alone left the stream at 15-19 GB/s where plain reads reach ~26 (2-core Emerald Rapids Xeon);
// loading the same k of the next block's rows while this block is summed keeps it at 22-27
// (docs/benchmarks.md, "Decode GEMMs at the read bandwidth"). Prefetches never fault, so the
// last block's run past W's end is harmless.
template <typename T, int64_t R = ROWS>
inline void prefetch_next_block(const T* const (&wr)[R], int64_t K, int64_t k) {
#if defined(__SSE__)
  for (int64_t r = 0; r < R; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(wr[r] + R * K + k), _MM_HINT_T0);
#else
  (void)wr, (void)K, (void)k;
#endif
}

// float32: ROWS weight rows x M input rows; accumulators are vectorised by the compiler.
template <int M>
inline void block_f32(float* y, const float* x, const float* w, const float* bias, int64_t n0,
                      int64_t rows, int64_t N, int64_t K) {
  float acc[M][ROWS] = {};
  const float* wr[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) wr[r] = w + (n0 + std::min(r, rows - 1)) * K;
  if constexpr (M == 1) {  // one row of x: the weight rows one after another, as
                           // dot_row_bf16 (1.03x here, a 24-layer stack + LM head, Zen 5)
    for (int64_t r = 0; r < ROWS; ++r) {
      const float* wrow = wr[r];
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; ++k) a += x[k] * wrow[k];
      acc[0][r] = a;
    }
  } else
  for (int m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t k = 0; k < K; ++k) {
      const float xv = xm[k];
      a0 += xv * wr[0][k];
      a1 += xv * wr[1][k];
      a2 += xv * wr[2][k];
      a3 += xv * wr[3][k];
    }
    acc[m][0] = a0, acc[m][1] = a1, acc[m][2] = a2, acc[m][3] = a3;
  }
  for (int m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r) y[m * N + n0 + r] = acc[m][r] + (bias ? bias[n0 + r] : 0.f);
}

// int8: products summed exactly in int32, as oneDNN's int8 GEMM: |sum| <= K * 128 * 128 fits
// int32 for K < 131072. On AVX2, 16 values at a time are sign-extended to int16 and multiplied
// pairwise into int32 (vpmaddwd); GCC does not find that for a plain loop (it widens to int32 and
// multiplies with vpmulld, about 3x slower), hence the intrinsics; other machines run the loop.
// AVX512BW builds take 32 at a time first (vpdpwssd where the CPU has AVX512-VNNI; the AVX2 and
// scalar loops take what is left).
inline int32_t dot_s8_tail(const int8_t* x, const int8_t* w, int64_t k0, int64_t K) {
  int32_t s = 0;
  for (int64_t k = k0; k < K; ++k) s += static_cast<int32_t>(x[k]) * static_cast<int32_t>(w[k]);
  return s;
}

// y[m * ldy + r]: the sums of weight row n0 + r with x's row m.
template <int M>
inline void block_s8(int32_t* y, const int8_t* x, const int8_t* w, int64_t n0, int64_t rows,
                     int64_t ldy, int64_t K) {
  const int8_t* wr[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) wr[r] = w + (n0 + std::min(r, rows - 1)) * K;
  for (int m = 0; m < M; ++m) {
    const int8_t* xm = x + m * K;
    int32_t acc[ROWS] = {};
    int64_t k = 0;
#if defined(__AVX512BW__)
    // 32 values a step in 16-bit lanes; with AVX512-VNNI the multiply-add is one instruction
    __m512i b0 = _mm512_setzero_si512(), b1 = b0, b2 = b0, b3 = b0;
    for (; k + 32 <= K; k += 32) {
      if (m == 0 && k % 64 == 0) prefetch_next_block(wr, K, k);
      const __m512i xv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + k)));
#if defined(__AVX512VNNI__)
#define QS_ROW(a, r) \
  a = _mm512_dpwssd_epi32(a, xv, _mm512_cvtepi8_epi16( \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + k))))
#else
#define QS_ROW(a, r) \
  a = _mm512_add_epi32(a, _mm512_madd_epi16(xv, _mm512_cvtepi8_epi16( \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + k)))))
#endif
      QS_ROW(b0, 0);
      QS_ROW(b1, 1);
      QS_ROW(b2, 2);
      QS_ROW(b3, 3);
#undef QS_ROW
    }
    acc[0] = _mm512_reduce_add_epi32(b0), acc[1] = _mm512_reduce_add_epi32(b1);
    acc[2] = _mm512_reduce_add_epi32(b2), acc[3] = _mm512_reduce_add_epi32(b3);
#endif
#if defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 16 <= K; k += 16) {
      if (m == 0 && k % 64 == 0) prefetch_next_block(wr, K, k);
      const __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xm + k)));
#define QS_ROW(a, r) \
  a = _mm256_add_epi32(a, _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16( \
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r] + k)))))
      QS_ROW(a0, 0);
      QS_ROW(a1, 1);
      QS_ROW(a2, 2);
      QS_ROW(a3, 3);
#undef QS_ROW
    }
    const __m256i sums[ROWS] = {a0, a1, a2, a3};
    for (int64_t r = 0; r < ROWS; ++r) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sums[r]);
      for (int j = 0; j < 8; ++j) acc[r] += lanes[j];
    }
#endif
    for (int64_t r = 0; r < ROWS; ++r) acc[r] += dot_s8_tail(xm, wr[r], k, K);
    for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = acc[r];
  }
}

#if defined(__AVX512BF16__)
// One weight row's dot product with x over its first K / 32 * 32 values, front to back in four
// independent sums, the same span of the row `ahead` values on prefetched. For one row of x
// (batch-1 decode) the block's rows are read one after the other, a single stream: read side
// by side (a step of each of 8 rows, 8 streams of 1,792 bytes at K = 896) they held the batch-1
// weights at 40 GB/s, 46 this way (24 layers + LM head of the Qwen2.5-0.5B shape, alternating
// in one process, Zen 5 EPYC; torch.sum's read 42-48 there).
inline float dot_row_bf16(const uint16_t* x, const uint16_t* w, int64_t K, int64_t ahead) {
  auto dot = [&](__m512 s, int64_t k) {
    return _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(w + k),
                            (__m512bh)_mm512_loadu_si512(x + k));
  };
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    for (int64_t j = 0; j < 128; j += 32)
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead + k + j), _MM_HINT_T0);
    s0 = dot(s0, k), s1 = dot(s1, k + 32), s2 = dot(s2, k + 64), s3 = dot(s3, k + 96);
  }
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + ahead + k), _MM_HINT_T0);
    s0 = dot(s0, k);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
#endif

// bf16: products summed in fp32 (as the AMX and oneDNN kernels), 32 values a step with
// AVX512-BF16's vdpbf16ps, the bias added in fp32 and one rounding to bf16 at the end (as
// F.linear; vec_math.h's conversions). Other builds take the scalar loop.
template <int M, int64_t R = BF16_ROWS>
inline void block_bf16(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                       int64_t n0, int64_t rows, int64_t N, int64_t K) {
  const uint16_t* wr[R];
  for (int64_t r = 0; r < R; ++r) wr[r] = w + (n0 + std::min(r, rows - 1)) * K;
  float acc[M][R] = {};
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (M == 1) {
    k = K / 32 * 32;
    for (int64_t r = 0; r < R; ++r) acc[0][r] = dot_row_bf16(x, wr[r], K, R * K);
  } else {
  __m512 a[M][R];
  for (int m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) a[m][r] = _mm512_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    prefetch_next_block<uint16_t, R>(wr, K, k);
    __m512bh wv[R];
    for (int64_t r = 0; r < R; ++r)
      wv[r] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wr[r] + k));
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * K + k));
      for (int64_t r = 0; r < R; ++r) a[m][r] = _mm512_dpbf16_ps(a[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_reduce_add_ps(a[m][r]);
  }
#endif
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) {
      const float xv = to_float(x[m * K + k]);
      for (int64_t r = 0; r < R; ++r) acc[m][r] += xv * to_float(wr[r][k]);
    }
  for (int m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r)
      y[m * N + n0 + r] = bf16_bits(acc[m][r] + (bias ? to_float(bias[n0 + r]) : 0.f));
}

using BlockF32 = void (*)(float*, const float*, const float*, const float*, int64_t, int64_t,
                          int64_t, int64_t);
using BlockS8 = void (*)(int32_t*, const int8_t*, const int8_t*, int64_t, int64_t, int64_t,
                         int64_t);
using BlockBF16 = void (*)(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int64_t,
                           int64_t, int64_t, int64_t);

constexpr int64_t MAX_M = 4;  // rows of x per block call

// The int8 block for 1 .. MAX_M rows of x (gemv_s8s32 and gemv_s8_scaled).
const BlockS8 kBlocksS8[MAX_M] = {block_s8<1>, block_s8<2>, block_s8<3>, block_s8<4>};

// Threads split the weight into blocks of R rows; each block meets every row of x, in groups
// of up to MAX_M, while it is hot in L1/L2: the weight is read from memory once for any M.
// ``block(i, n0, rows, m)`` runs weight rows n0 .. n0+rows-1 against rows m .. m+i of x.
template <int64_t R = ROWS, typename Block>
int dispatch(int64_t M, int64_t N, int64_t K, const Block& block) {
  if (N <= 0 || K <= 0 || M <= 0) return 1;
  const int64_t nblocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n0 = b * R, rows = std::min(R, N - n0);
    for (int64_t m = 0; m < M; m += MAX_M) block(std::min(MAX_M, M - m) - 1, n0, rows, m);
  }
  return 0;
}

}  // namespace

extern "C" {

// x [M, K], w [N, K], y [M, N]; all contiguous; bias [N] or null (float32 and bf16: added in
// fp32 before the one rounding). Each returns 0, or 1 for an empty shape.
int gemv_f32(float* y, const float* x, const float* w, const float* bias, int64_t M, int64_t N,
             int64_t K) {
  static const BlockF32 blocks[MAX_M] = {block_f32<1>, block_f32<2>, block_f32<3>, block_f32<4>};
  return dispatch(M, N, K, [&](int64_t i, int64_t n0, int64_t rows, int64_t m) {
    blocks[i](y + m * N, x + m * K, w, bias, n0, rows, N, K);
  });
}

int gemv_s8s32(int32_t* y, const int8_t* x, const int8_t* w, int64_t M, int64_t N, int64_t K) {
  return dispatch(M, N, K, [&](int64_t i, int64_t n0, int64_t rows, int64_t m) {
    kBlocksS8[i](y + m * N + n0, x + m * K, w, n0, rows, N, K);
  });
}

// W8A8's whole GEMM: int8 x [M, K], w [N, K] -> y [M, N] float32 (out_bf16 == 0) or bf16,
//   y = T(T32(T32(float(sum + bias[n]) * scale[n]) * token_scale[m]))
// with bias [N] int32 and token_scale [M] optional (null), each product rounded to fp32 in
// that order, as int32_epilogue's torch ops compute it (the same values), where those ops cost
// 6-10 us a call (four small tensors a GEMM: ~0.7 ms of a batch-1 W8A8 step). out_bias [N]
// (optional, in y's dtype) is then added as a layer's float bias is, y = T(y + out_bias[n]).
int gemv_s8_scaled(void* y, const int8_t* x, const int8_t* w, const float* scale,
                   const float* token_scale, const int32_t* bias, const void* out_bias,
                   int64_t M, int64_t N, int64_t K, int out_bf16) {
  return dispatch(M, N, K, [&](int64_t i, int64_t n0, int64_t rows, int64_t m) {
    int32_t acc[MAX_M * ROWS];
    kBlocksS8[i](acc, x + m * K, w, n0, rows, ROWS, K);
    for (int64_t j = 0; j <= i; ++j)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        float v = static_cast<float>(bias ? acc[j * ROWS + r] + bias[n] : acc[j * ROWS + r]);
        v *= scale[n];
        // no reassociation into v * (scale * token_scale) (-fassociative-math is on here)
        asm("" : "+m"(v));
        if (token_scale) v *= token_scale[m + j];
        if (out_bf16) {
          uint16_t out = bf16_bits(v);
          if (out_bias)  // the scaled value rounds first, as y + bias does on the bf16 y
            out = bf16_bits(to_float(out) + to_float(static_cast<const uint16_t*>(out_bias)[n]));
          static_cast<uint16_t*>(y)[(m + j) * N + n] = out;
        } else {
          static_cast<float*>(y)[(m + j) * N + n] =
              out_bias ? v + static_cast<const float*>(out_bias)[n] : v;
        }
      }
  });
}

// 1 where this build sums bf16 with AVX512-BF16 (vdpbf16ps), else 0 (its scalar loop is slow).
int gemv_bf16_fast() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// bf16 x [M, K], w [N, K], bias [N] or null -> bf16 y [M, N] (fp32 sums, one rounding).
int gemv_bf16(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t M,
              int64_t N, int64_t K) {
  static const BlockBF16 blocks[MAX_M] = {block_bf16<1>, block_bf16<2>, block_bf16<3>,
                                          block_bf16<4>};
  return dispatch<BF16_ROWS>(M, N, K, [&](int64_t i, int64_t n0, int64_t rows, int64_t m) {
    blocks[i](y + m * N, x + m * K, w, bias, n0, rows, N, K);
  });
}

}  // extern "C"
