// Paged decode attention on CPU: one query token per sequence, attending over its context
// where it lies in the paged KV cache (no gathered copy of K and V).
//
//   k_cache, v_cache [num_slots, Hkv, D]   slot of position p of sequence i:
//                                          tables[i * table_width + p / bs] * bs + p % bs
//   q, out           [n, Hq, D]            the G = Hq / Hkv query heads of KV head h are
//                                          rows h*G .. h*G+G-1 (grouped-query attention)
//
// One task per sequence, one pass per KV head: the G query heads of a KV head share every K
// and V row they read, so each row is loaded once. Scores are kept for the whole context (two
// passes: scores, then softmax-weighted V), in float32 whatever the cache dtype. Rows are
// handled as vectors of 8 floats (GCC vector extensions: AVX2 where the machine has it, SSE
// pairs elsewhere); the G dot products of a row are independent chains, so they overlap in the
// core. Heads of 64, 128 or 256 take decode_seq16 instead on AVX512 CPUs, fp32 caches and (with
// AVX512-BF16) bf16 ones: all KV heads of a sequence in one pass over its blocks, K in place
// (vdpbf16ps for bf16), softmax and 16-wide FMAs on V block by block. bf16 caches on CPUs with
// AMX take amx_decode (tile products, below) where 2-16 query heads share a KV head. Plain C++
// over raw pointers, called through ctypes: it builds in seconds and needs no torch headers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "amx_tiles.h"
#include "vec_math.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t W = 8;  // floats per v8

inline void load_row(v8* dst, const float* src, int64_t chunks) {
  std::memcpy(dst, src, chunks * sizeof(v8));
}
inline void load_row(v8* dst, const uint16_t* src, int64_t chunks) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);  // bf16 is float32's high half
#pragma omp simd
  for (int64_t j = 0; j < chunks * W; ++j) bits[j] = static_cast<uint32_t>(src[j]) << 16;
}

inline float hsum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

typedef int32_t i8v __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i8v{__VA_ARGS__})
#endif

// The lane sums of eight vectors at once: result lane i = hsum(s[i]), in 14 shuffles and 7
// adds where eight hsums take ~80 scalar operations.
inline v8 pair_sums(v8 x, v8 y) {  // [x 01, y 01, x 23, y 23, x 45, y 45, x 67, y 67]
  return SHUFFLE(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
}

inline v8 hsum8(const v8* s) {
  const v8 a = pair_sums(s[0], s[1]), b = pair_sums(s[2], s[3]);
  const v8 c = pair_sums(s[4], s[5]), d = pair_sums(s[6], s[7]);
  const v8 e = SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8 f = SHUFFLE(c, d, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(c, d, 2, 3, 10, 11, 6, 7, 14, 15);
  // e = [s0 0-3, s1 0-3, s2 0-3, s3 0-3, s0 4-7, s1 4-7, s2 4-7, s3 4-7], f for s4-s7
  return SHUFFLE(e, f, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(e, f, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Each of the rows [rows, len] of scores becomes exp(s - max); inv[r] = 1 / its sum (0 for an
// empty row), applied to the weighted sum of V at the end.
inline void softmax_rows(float* scores, float* inv, int64_t rows, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    const float mx = max_of(sr, len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      sr[p] = exp_approx(sr[p] - mx);
      total += sr[p];
    }
    inv[r] = total > 0.f ? 1.f / total : 0.f;
  }
}

// The next block's rows of one head (a block's positions lie wherever the pool put them, so
// the hardware prefetchers cannot guess it), one request per 64-byte line: 64 x 264-token
// contexts x 24 layers, bf16, from a DRAM-sized cache with shuffled blocks: 27.2 -> 22.5 ms.
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride, int64_t d) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < d; j += line) __builtin_prefetch(first + t * stride + j, 0, 3);
}

// The next block's slots are prefetched a few at a time, spread over this block's work (one
// share per query head, in both passes): a block's worth at once stalled on the line-fill
// buffers, and a third of the kernel's samples sat on those prefetches (64 x 300-token contexts
// x 24 layers, bf16 kernel: 23.4 -> 20.4 ms; no software prefetch at all: 27-30 ms; generic
// kernel, fp32: 35.3 / 37.5 -> 31.9 / 34.7 ms, bf16 built for AVX2: 28.4 / 27.0 -> 27.1 / 26.2).
// Share `part` of `per_part` slots, `width` values of each (from `next`: a row of one KV head,
// or a whole slot); next == null: this is the last block. Always inlined: GCC kept it a call,
// and a call in the passes' loops spills every vector register (all caller-saved): 21 -> 29 ms.
template <typename T>
__attribute__((always_inline)) inline void prefetch_share(const T* next, int64_t part,
                                                          int64_t per_part, int64_t block_size,
                                                          int64_t slot_stride, int64_t width) {
  if (next == nullptr) return;
  const int64_t first = part * per_part;
  const int64_t last = std::min(block_size, first + per_part);
  if (first < last) prefetch_rows(next + first * slot_stride, last - first, slot_stride, width);
}

// D % 8 == 0 (checked by the caller): rows are D / 8 vectors. CH > 0 fixes D / 8 at compile
// time for the common head sizes: the per-row loops unroll and a query's rows (scores) or
// accumulator (values) stay in registers; CH == 0 handles any D (loops over memory, 2-3x
// slower). Each KV block's rows are widened to float32 once into a buffer, then every query
// head of the group runs over the buffer with its own registers: no accumulator round trip
// through memory per position, and independent chains for the core to overlap.
template <typename T, int CH>
void decode_one(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t len, int64_t h, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                float scale) {
  const int64_t group = hq / hkv, slot_stride = hkv * d, chunks = CH > 0 ? CH : d / W;
  // per-thread buffers, reused across tasks and calls (see decode_seq16)
  static thread_local std::vector<v8> qv_buf, acc_buf, rows_buf;
  static thread_local std::vector<float> scores_buf, inv_buf;
  qv_buf.resize(group * chunks), acc_buf.assign(group * chunks, v8{});
  rows_buf.resize(block_size * chunks), scores_buf.resize(group * len), inv_buf.resize(group);
  // plain pointers for the loops (see decode_seq16: no thread_local lookup inside them)
  v8* const qv = qv_buf.data();
  v8* const acc = acc_buf.data();
  v8* const rows = rows_buf.data();
  float* const scores = scores_buf.data();
  float* const inv = inv_buf.data();
  float* qf = reinterpret_cast<float*>(qv);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < d; ++j) qf[g * d + j] = to_float(q[(h * group + g) * d + j]) * scale;
  const int64_t slots_per_head = (block_size + group - 1) / group;  // prefetch_share's

  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t base = table[b] * block_size, count = std::min(block_size, len - start);
    const T* next = start + block_size < len
                        ? k_cache + table[b + 1] * block_size * slot_stride + h * d
                        : nullptr;
    for (int64_t t = 0; t < count; ++t)
      load_row(rows + t * chunks, k_cache + (base + t) * slot_stride + h * d, chunks);
    for (int64_t g = 0; g < group; ++g) {
      prefetch_share(next, g, slots_per_head, block_size, slot_stride, d);
      v8 qg[CH > 0 ? CH : 1];
      const v8* qsrc = qv + g * chunks;
      if constexpr (CH > 0)
        for (int c = 0; c < CH; ++c) qg[c] = qsrc[c];
      float* sg = scores + g * len + start;
      int64_t t = 0;
      if constexpr (CH > 0) {
        for (; t + W <= count; t += W) {  // eight positions: independent chains, one reduction
          v8 s8[W];
          for (int p = 0; p < W; ++p) {
            const v8* r = rows + (t + p) * CH;
            v8 s{};
            for (int c = 0; c < CH; ++c) s += r[c] * qg[c];
            s8[p] = s;
          }
          const v8 total = hsum8(s8);
          std::memcpy(sg + t, &total, sizeof total);
        }
      }
      for (; t < count; ++t) {
        const v8* r = rows + t * chunks;
        v8 s{};
        if constexpr (CH > 0) {
          for (int c = 0; c < CH; ++c) s += r[c] * qg[c];
        } else {
          for (int64_t c = 0; c < chunks; ++c) s += r[c] * qsrc[c];
        }
        sg[t] = hsum(s);
      }
    }
  }
  softmax_rows(scores, inv, group, len);
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t base = table[b] * block_size, count = std::min(block_size, len - start);
    const T* next = start + block_size < len
                        ? v_cache + table[b + 1] * block_size * slot_stride + h * d
                        : nullptr;
    for (int64_t t = 0; t < count; ++t)
      load_row(rows + t * chunks, v_cache + (base + t) * slot_stride + h * d, chunks);
    for (int64_t g = 0; g < group; ++g) {
      prefetch_share(next, g, slots_per_head, block_size, slot_stride, d);
      const float* wg = scores + g * len + start;
      v8* a = acc + g * chunks;
      if constexpr (CH > 0) {
        v8 ar[CH];
        for (int c = 0; c < CH; ++c) ar[c] = a[c];
        for (int64_t t = 0; t < count; ++t) {
          const v8* r = rows + t * CH;
          for (int c = 0; c < CH; ++c) ar[c] += wg[t] * r[c];
        }
        for (int c = 0; c < CH; ++c) a[c] = ar[c];
      } else {
        for (int64_t t = 0; t < count; ++t)
          for (int64_t c = 0; c < chunks; ++c) a[c] += wg[t] * rows[t * chunks + c];
      }
    }
  }
  const float* af = reinterpret_cast<const float*>(acc);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < d; ++j) store(out + (h * group + g) * d + j, af[g * d + j] * inv[g]);
}

// A sequence's KV heads h0 .. h1-1 in turn, in one task (the second head finds the block's
// lines in L2).
template <typename T, int CH>
void decode_seq(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                float scale, int64_t h0, int64_t h1) {
  for (int64_t h = h0; h < h1; ++h)
    decode_one<T, CH>(out, q, k_cache, v_cache, table, len, h, hq, hkv, d, block_size, scale);
}

#if defined(__AVX512F__)
// 16 lanes on AVX512 CPUs, for fp32 caches and (with AVX512-BF16: Sapphire Rapids, Zen 4) bf16
// ones: the scores take K in place (bf16: vdpbf16ps, 32 bf16 products summed pairwise into 16
// fp32 lanes, each product exact, so a 64-dim dot product is two instructions; fp32: 16-wide
// FMAs), and sixteen positions' lane vectors are reduced together (hsum16: 45 operations for 16
// sums). fp32 V is summed with 16-wide FMAs; bf16 V is interleaved once per block in pairs of
// positions and summed with vdpbf16ps, two positions a step, the weights rounded to bf16 (as the
// AMX kernel's; sum_pairs: 1.24x the kernel in cache, 1.04x from memory where the host read
// ~42 GB/s, Zen 5). Scores, softmax and the sums stay fp32, as in the generic kernel; the
// summation order differs, and the exponentials are exp16's (the same polynomial as exp_approx,
// within an ulp of it). The generic kernel's 8-lane vectors left an fp32 cache at half the width
// of the CPU's.
typedef int32_t i16v __attribute__((vector_size(64)));
typedef float f16v __attribute__((vector_size(64)));
#if defined(__clang__)
#define SHUFFLE16(a, b, ...) ((__m512)__builtin_shufflevector((f16v)(a), (f16v)(b), __VA_ARGS__))
#else
#define SHUFFLE16(a, b, ...) \
  ((__m512)__builtin_shuffle((f16v)(a), (f16v)(b), i16v{__VA_ARGS__}))
#endif

inline __m512 pair_sums16(__m512 x, __m512 y) {  // [x 01, y 01, x 23, y 23, ...]
  return _mm512_add_ps(SHUFFLE16(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                       SHUFFLE16(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));
}

// Lane i of the result: the sum of s[i]'s 16 lanes.
inline __m512 hsum16(const __m512* s) {
  __m512 p[8], e[4], g[2];
  for (int i = 0; i < 8; ++i) p[i] = pair_sums16(s[2 * i], s[2 * i + 1]);
  for (int i = 0; i < 4; ++i)  // four vectors' partial sums side by side
    e[i] = _mm512_add_ps(
        SHUFFLE16(p[2 * i], p[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                  29),
        SHUFFLE16(p[2 * i], p[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                  31));
  for (int i = 0; i < 2; ++i)  // eight vectors'
    g[i] = _mm512_add_ps(
        SHUFFLE16(e[2 * i], e[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                  27),
        SHUFFLE16(e[2 * i], e[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                  31));
  return _mm512_add_ps(
      SHUFFLE16(g[0], g[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
      SHUFFLE16(g[0], g[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
}

// How the 16-lane kernel reads each cache dtype: a query head's row as VC / Rows::STEP vectors
// of Q (its dot products with K's rows take those in place) and V's rows as fp32 vectors.
struct F32Rows {
  using T = float;
  using Q = __m512;
  static constexpr int STEP = 1;  // fp32 vectors a Q vector spans
  static constexpr bool PAIRS = false;  // P . V as fp32 FMAs on V widened (else sum_pairs)
  static Q load_q(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 dot(__m512 s, Q q, const float* k) {
    return _mm512_fmadd_ps(q, _mm512_loadu_ps(k), s);
  }
  static __m512 load_v(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 lo, __m512 hi) {
    _mm512_storeu_ps(p, lo);
    _mm512_storeu_ps(p + 16, hi);
  }
};
#if defined(__AVX512BF16__)
struct Bf16Rows {
  using T = uint16_t;
  using Q = __m512bh;
  static constexpr int STEP = 2;
  static constexpr bool PAIRS = true;
  static Q load_q(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 dot(__m512 s, Q q, const uint16_t* k) {
    return _mm512_dpbf16_ps(s, q, (__m512bh)_mm512_loadu_si512(k));
  }
  static __m512 load_v(const uint16_t* p) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)p));
  }
  static void store(uint16_t* p, __m512 lo, __m512 hi) {  // 32 bf16, nearest even
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
};
#endif

// Output dims of 32 dims' pair vectors (unpacklo of two bf16 rows: lanes -> dims 0-3, 8-11, ..;
// unpackhi: 4-7, 12-15, ..), as indices into [lo | hi] for dims 0-15 and 16-31 (the AMX
// kernel's tile columns are the same lanes).
alignas(64) constexpr int32_t UNDO_LO[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t UNDO_HI[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                              12, 13, 14, 15, 28, 29, 30, 31};

template <typename Rows, int VC>  // VC = D / 16: fp32 vectors per row
inline __m512 dot16(const typename Rows::Q* qg, const typename Rows::T* k) {
  __m512 s = _mm512_setzero_ps();
  for (int c = 0; c < VC / Rows::STEP; ++c) s = Rows::dot(s, qg[c], k + 16 * Rows::STEP * c);
  return s;
}

#if defined(__AVX512BF16__)
// One head's weighted sum of a block's V rows, two positions a vdpbf16ps: acc[VC] (the pairs'
// lane order) += w[2r] V[2r] + w[2r+1] V[2r+1] over `count` pairs, w the head's bf16 weights
// (read as one 32-bit pair each), pairs[r * stride + c] the KV head's interleaved rows. Half the
// multiply-adds of fp32 FMAs on widened rows, and no widening; the weights rounded to bf16 (as
// the AMX kernel's P tiles) are the one difference in precision. Two accumulator sets (even and
// odd pairs) for heads up to 128, as the fp32 loop.
template <int VC>
inline void sum_pairs(__m512* acc, const __m512i* pairs, int64_t stride, const uint16_t* w,
                      int64_t count) {
  auto weight = [&](int64_t r) {
    int32_t both;
    std::memcpy(&both, w + 2 * r, sizeof both);
    return (__m512bh)_mm512_set1_epi32(both);
  };
  __m512 a[VC], o[VC];
  for (int c = 0; c < VC; ++c) a[c] = acc[c], o[c] = _mm512_setzero_ps();
  int64_t r = 0;
  if constexpr (VC < 16) {
    for (; r + 2 <= count; r += 2) {
      const __m512bh w0 = weight(r), w1 = weight(r + 1);
      for (int c = 0; c < VC; ++c) {
        a[c] = _mm512_dpbf16_ps(a[c], w0, (__m512bh)pairs[r * stride + c]);
        o[c] = _mm512_dpbf16_ps(o[c], w1, (__m512bh)pairs[(r + 1) * stride + c]);
      }
    }
  }
  for (; r < count; ++r) {
    const __m512bh w0 = weight(r);
    for (int c = 0; c < VC; ++c) a[c] = _mm512_dpbf16_ps(a[c], w0, (__m512bh)pairs[r * stride + c]);
  }
  for (int c = 0; c < VC; ++c) acc[c] = _mm512_add_ps(a[c], o[c]);
}
#endif

template <typename Rows, int VC>
void decode_seq16(typename Rows::T* out, const typename Rows::T* q,
                  const typename Rows::T* k_cache, const typename Rows::T* v_cache,
                  const int64_t* table, int64_t len, int64_t hq, int64_t hkv, int64_t d,
                  int64_t block_size, float scale, int64_t h0, int64_t h1) {
  using T = typename Rows::T;
  constexpr int QV = VC / Rows::STEP;  // Q vectors per head's row
  constexpr bool kPairs = Rows::PAIRS;
  const int64_t group = hq / hkv, slot_stride = hkv * d;
  // this task's query heads (local index: head - first; its KV head h0 + head / group) and the
  // width of their K/V columns (block rows below start at KV head h0's)
  const int64_t first = h0 * group, heads = (h1 - h0) * group, width = (h1 - h0) * d;
  const int64_t row_vectors = (h1 - h0) * VC;
  // Per-thread buffers, grown as needed and kept (scores: Hq x the longest context seen, 4 MB
  // at 64k tokens and Hq = 16), reused across tasks and calls: allocating and zeroing them per
  // task cost 20-30% of the kernel at short contexts (64 x 32 tokens x 24 layers: 2.6-3.1 ->
  // 2.0-2.1 ms). scores are written before they are read; acc and total are cleared.
  static thread_local std::vector<float> scores_buf, weights_buf;
  static thread_local std::vector<__m512> rows_buf, acc_buf, shift_buf, total_buf;
  static thread_local std::vector<typename Rows::Q> qv_buf;
  scores_buf.resize(heads * len), rows_buf.resize(block_size * row_vectors);
  shift_buf.resize(heads), qv_buf.resize(heads * QV);
  const int64_t block16 = (block_size + 15) / 16 * 16;  // a head's weights of a block
  weights_buf.resize(heads * block16);
  acc_buf.assign(heads * VC, _mm512_setzero_ps()), total_buf.assign(heads, _mm512_setzero_ps());
  // plain pointers for the loops: each use of a thread_local in them was a __tls_get_addr
  // call, with every live vector register saved and reloaded around it (GCC did not hoist it)
  float* const scores = scores_buf.data();
  __m512* const rows = rows_buf.data();
  __m512* const acc = acc_buf.data();
  __m512* const shift = shift_buf.data();
  __m512* const total = total_buf.data();
  typename Rows::Q* const qv = qv_buf.data();
  float* const weights = weights_buf.data();
  // bf16 caches: V's rows in pairs of positions and the weights rounded to bf16, so that
  // vdpbf16ps sums two positions' products a step (sum_pairs); in the same buffers
  __m512i* const pairs = reinterpret_cast<__m512i*>(rows);
  uint16_t* const weights16 = reinterpret_cast<uint16_t*>(weights);
  const __m512i undo_lo = _mm512_load_si512(UNDO_LO), undo_hi = _mm512_load_si512(UNDO_HI);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t head = 0; head < heads; ++head)
    for (int c = 0; c < QV; ++c)
      qv[head * QV + c] = Rows::load_q(q + (first + head) * d + 16 * Rows::STEP * c);
  const int64_t slots_per_head = (block_size + heads - 1) / heads;  // prefetch_share's
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const T* kb = k_cache + table[b] * block_size * slot_stride + h0 * d;
    const T* next = start + block_size < len
                               ? k_cache + table[b + 1] * block_size * slot_stride + h0 * d
                               : nullptr;
    const int64_t count = std::min(block_size, len - start);
    for (int64_t head = 0; head < heads; ++head) {
      prefetch_share(next, head, slots_per_head, block_size, slot_stride, width);
      const typename Rows::Q* qg = qv + head * QV;
      const T* kh = kb + (head / group) * d;
      float* sg = scores + head * len + start;
      int64_t t = 0;
      for (; t + 16 <= count; t += 16) {
        __m512 s16[16];
        for (int p = 0; p < 16; ++p) s16[p] = dot16<Rows, VC>(qg, kh + (t + p) * slot_stride);
        _mm512_storeu_ps(sg + t, _mm512_mul_ps(hsum16(s16), vscale));
      }
      for (; t < count; ++t)
        sg[t] = _mm512_reduce_add_ps(dot16<Rows, VC>(qg, kh + t * slot_stride)) * scale;
    }
  }
  // Softmax's shift: each head's largest score. The exponentials are taken block by block in
  // the V pass below, 16 lanes at a time, where the weights are used (no pass of their own
  // over the scores: 64 x 300-token contexts x 24 layers, 21.9 -> 21.4 ms).
  for (int64_t head = 0; head < heads; ++head)
    shift[head] = _mm512_set1_ps(max16(scores + head * len, len));
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const T* vb = v_cache + table[b] * block_size * slot_stride + h0 * d;
    const T* next = start + block_size < len
                               ? v_cache + table[b + 1] * block_size * slot_stride + h0 * d
                               : nullptr;
    const int64_t count = std::min(block_size, len - start);
    if constexpr (kPairs) {
      // positions 2r and 2r+1 interleaved, 32 dims at a time (unpacklo/hi: 16 lanes of
      // (position 2r, position 2r+1) values each), the partner of a last odd position zeros
      for (int64_t r = 0; 2 * r < count; ++r) {
        const T* x = vb + 2 * r * slot_stride;
        const T* y = 2 * r + 1 < count ? x + slot_stride : nullptr;
        __m512i* dst = pairs + r * row_vectors;
        for (int c = 0; c < row_vectors / 2; ++c) {
          const __m512i a = _mm512_loadu_si512(x + 32 * c);
          const __m512i b = y ? _mm512_loadu_si512(y + 32 * c) : _mm512_setzero_si512();
          dst[2 * c] = _mm512_unpacklo_epi16(a, b);
          dst[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
      }
    } else {
      for (int64_t t = 0; t < count; ++t) {  // the task's heads' V rows widened to fp32 once
        for (int c = 0; c < row_vectors; ++c)
          rows[t * row_vectors + c] = Rows::load_v(vb + t * slot_stride + 16 * c);
      }
    }
    // the block's softmax weights (unnormalised) of every head first: independent exp chains
    // that overlap, where one head's exp ahead of its own FMAs left the core waiting on it
    // and on the weights' store (64 x 300-token contexts, one layer in cache: ~20% of the
    // kernel's samples)
    for (int64_t head = 0; head < heads; ++head)
      for (int64_t sub = 0; sub < count; sub += 16) {
        const __mmask16 live = tail_mask(count - sub);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(
            _mm512_maskz_loadu_ps(live, scores + head * len + start + sub), shift[head])));
        total[head] = _mm512_add_ps(total[head], e);
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights16 + head * block16 + sub),
                              (__m256i)_mm512_cvtneps_pbh(e));
          continue;
        }
#endif
        _mm512_storeu_ps(weights + head * block16 + sub, e);
      }
    for (int64_t head = 0; head < heads; ++head) {
      prefetch_share(next, head, slots_per_head, block_size, slot_stride, width);
#if defined(__AVX512BF16__)
      if constexpr (kPairs) {
        sum_pairs<VC>(acc + head * VC, pairs + (head / group) * VC, row_vectors,
                      weights16 + head * block16, (count + 1) / 2);
        continue;
      }
#endif
      const __m512* rh = rows + (head / group) * VC;
      const float* w = weights + head * block16;
      // Heads of up to 128: two sets of accumulators (even and odd positions), twice the
      // independent FMA chains, so the FMA units are not waiting on the previous position's
      // sums (4-cycle latency). Heads of 256 have 16 chains in one set, and two sets took all
      // 32 registers and spilled (6 layers of 8 x 256 heads: 18.9 -> 15.7 ms with one).
      __m512 a[VC], o[VC];
      for (int c = 0; c < VC; ++c) a[c] = acc[head * VC + c], o[c] = _mm512_setzero_ps();
      int64_t t = 0;
      if constexpr (VC < 16) {
        for (; t + 2 <= count; t += 2) {
          const __m512 w0 = _mm512_set1_ps(w[t]), w1 = _mm512_set1_ps(w[t + 1]);
          for (int c = 0; c < VC; ++c) {
            a[c] = _mm512_fmadd_ps(w0, rh[t * row_vectors + c], a[c]);
            o[c] = _mm512_fmadd_ps(w1, rh[(t + 1) * row_vectors + c], o[c]);
          }
        }
      }
      for (; t < count; ++t) {
        const __m512 w0 = _mm512_set1_ps(w[t]);
        for (int c = 0; c < VC; ++c) a[c] = _mm512_fmadd_ps(w0, rh[t * row_vectors + c], a[c]);
      }
      for (int c = 0; c < VC; ++c) acc[head * VC + c] = _mm512_add_ps(a[c], o[c]);
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    const float sum = _mm512_reduce_add_ps(total[head]);  // as softmax_rows: 0 for no context
    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
    for (int c = 0; c < VC; c += 2) {
      __m512 lo = acc[head * VC + c], hi = acc[head * VC + c + 1];
      if constexpr (kPairs) {  // the pairs' lanes back in dim order
        const __m512 d0 = _mm512_permutex2var_ps(lo, undo_lo, hi);
        hi = _mm512_permutex2var_ps(lo, undo_hi, hi), lo = d0;
      }
      Rows::store(out + (first + head) * d + 16 * c, _mm512_mul_ps(lo, inv),
                  _mm512_mul_ps(hi, inv));
    }
  }
}
#endif

#if defined(QS_AMX)
// bf16 caches on CPUs with AMX, heads sharing a KV head 4 or more (most Qwen models). Both
// products are tile products, with K read in place:
//   scores^T [16 positions x 16 query heads] += K [16 positions x 32 dims] . Q^T [32 dims x 16]
// K's rows, as the cache holds them, are an A tile (a row of 64 bytes: 32 dims of a position;
// the rows slot_stride apart), so K is never moved or widened; Q^T is a B tile built once per
// call, one per KV head and 32 dims, holding only that KV head's query heads (the other columns
// zero), so the KV heads of a range add into one C tile. One 16 x 16 transpose per 16 positions
// then turns the scores into rows per query head. The weighted sum of V:
//   out [16 heads x 16 dims] += P [16 heads x 32 positions] . V [32 positions x 16 dims]
// with P's rows (the softmax weights, rounded to bf16) zero but for one KV head's heads, and V's
// rows interleaved in pairs of positions (unpacklo/hi of two rows: 4 of each 8 dims a tile,
// undone on the output). Two passes as the kernels above (scores for the whole context, then
// weights and V), sums in fp32; rounding the weights to bf16 is the one difference in precision
// (the prefill kernel does the same). An earlier version with Q as the A tile had to transpose
// K into B tiles and spent 3/4 of its time on it (docs/benchmarks.md).
namespace amx_decode {

using qs_amx::TILE;

// The first lines of a row of `values` (at most 4: the hardware prefetchers stream the rest of
// a row once it is touched). Every line of it stalled on the line-fill buffers where rows are
// long: 16 rows x 16 lines a 16-position group at heads of 256 (6 layers of 8 x 256 heads, 64 x
// 272 tokens: 9.1 -> 6.8 ms; 28 layers of 16 / 8 x 128 heads: 106.5 -> 91.7 ms; heads of 64
// from memory, 4 lines a row either way: 34.2 -> 33.0 ms; none at all: 36.3).
inline void prefetch_lines(const uint16_t* p, int64_t values) {
  for (int64_t j = 0; j < std::min<int64_t>(values, 128); j += 32)
    _mm_prefetch(reinterpret_cast<const char*>(p + j), _MM_HINT_T0);
}

// The first lines of a row into L2 (prefetch_lines's four), for the lead below.
inline void prefetch_lines_l2(const uint16_t* p, int64_t values) {
  for (int64_t j = 0; j < std::min<int64_t>(values, 128); j += 32)
    _mm_prefetch(reinterpret_cast<const char*>(p + j), _MM_HINT_T1);
}

// Groups of 16 positions a task's rows are brought into L2 ahead of their reading, over its K
// groups and then its V groups (besides the one-step-ahead prefetches into L1). Heads of 64 with
// two KV heads make 256-byte rows, islands the hardware prefetchers do not follow, and the
// one-step lead left the kernel waiting on memory in the engine, where the weights' stream
// evicts the cache from L3: 64 x ~330-token contexts x 24 layers, replayed decode steps, lower
// in each of 12 alternating pairs of runs, 12.7-14.3 -> 11.9-13.4 ms (median gain ~0.7 ms; 3
// groups ahead 12.7, 6 12.3-12.4, 16 12.3-12.4; the first groups all at once at the start, or
// one block-table lookup a row: no better than none). Only for rows of up to 256 bytes:
// Qwen3.5's 1 KB rows (two KV heads of 256), whose lines the hardware prefetchers stream once a
// row is touched, measured 0.4-1.0 ms slower with it (6 layers, 11.8-12.3 -> 12.7-12.8 ms).
constexpr int64_t kL2Ahead = 10;

// KV heads h0 .. h1-1 of one sequence, (h1 - h0) * group <= 16 query heads. block_size % 16 ==
// 0, so 16 positions from a multiple of 16 lie in one block (rows past the context are read,
// inside that block, and their scores never used).
template <int CH>  // CH = D / 32
void decode_range(uint16_t* out, const uint16_t* q, const uint16_t* k_cache,
                  const uint16_t* v_cache, const int64_t* table, int64_t len, int64_t group,
                  int64_t hkv, int64_t block_size, float scale, int64_t h0, int64_t h1) {
  constexpr int64_t D = 32 * CH, DT = D / 16;  // dims; 16-dim output tiles
  const int64_t slot_stride = hkv * D, nkv = h1 - h0, heads = nkv * group, first = h0 * group;
  const int64_t groups16 = (len + 15) / 16, width = (len + 31) / 32 * 32;
  static thread_local std::vector<uint16_t> qt_buf, weights_buf, vt_buf;
  static thread_local std::vector<float> craw_buf, scores_buf;
  qt_buf.resize(nkv * CH * TILE), craw_buf.resize(groups16 * 256), scores_buf.resize(16 * width);
  weights_buf.assign(nkv * TILE, 0), vt_buf.resize(nkv * DT * TILE);
  // plain pointers for the loops (see decode_seq16: no thread_local lookup inside them)
  uint16_t* const qt = qt_buf.data();
  uint16_t* const weights = weights_buf.data();
  uint16_t* const vt = vt_buf.data();
  float* const craw = craw_buf.data();
  float* const scores = scores_buf.data();
  alignas(64) float acc[16 * D];
  // Q^T tiles: a KV head's query heads' rows (others zero) as 32-bit pairs, transposed
  for (int64_t j = 0; j < nkv; ++j)
    for (int c = 0; c < CH; ++c) {
      __m512 rows[16], cols[16];
      for (int64_t r = 0; r < 16; ++r)
        rows[r] = r / group == j && r < heads
                      ? _mm512_loadu_ps(q + (first + r) * D + 32 * c)
                      : _mm512_setzero_ps();
      qs_amx::transpose16(rows, cols);
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(qt + (j * CH + c) * TILE + 32 * r,
                                                   cols[r]);
    }
  // position t's row (KV heads h0..) in the K or V cache; the next positions of its block
  // follow slot_stride apart
  auto row_of = [&](const uint16_t* cache, int64_t t) {
    return cache + (table[t / block_size] * block_size + t % block_size) * slot_stride + h0 * D;
  };
  // Group c of the task's K groups followed by its V groups: its first row and row count
  const bool lead_l2 = nkv * D <= 128;
  auto lead_group = [&](int64_t c, int64_t* rows) -> const uint16_t* {
    const int64_t t = 16 * (c < groups16 ? c : c - groups16);
    *rows = lead_l2 && c < 2 * groups16 ? std::min<int64_t>(16, len - t) : 0;
    return *rows > 0 ? row_of(c < groups16 ? k_cache : v_cache, t) : nullptr;
  };
  // scores^T of 16 positions at a time, into craw [groups16][16 positions][16 heads]
  for (int64_t g = 0; g < groups16; ++g) {
    const uint16_t* kb = row_of(k_cache, 16 * g);
    if (g + 1 < groups16) {  // the next block's rows (hardware prefetchers cannot guess it)
      const uint16_t* next = row_of(k_cache, 16 * g + 16);
      for (int r = 0; r < 16; ++r) prefetch_lines(next + r * slot_stride, nkv * D);
    }
    int64_t lead_rows;
    const uint16_t* lead = lead_group(g + kL2Ahead, &lead_rows);
    for (int64_t r = 0; r < lead_rows; ++r) prefetch_lines_l2(lead + r * slot_stride, nkv * D);
    _tile_zero(0);
    for (int64_t j = 0; j < nkv; ++j)
      for (int c = 0; c < CH; ++c) {
        _tile_loadd(1, kb + j * D + 32 * c, slot_stride * 2);
        _tile_loadd(2, qt + (j * CH + c) * TILE, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    _tile_stored(0, craw + g * 256, 64);
  }
  // rows per head, scaled: scores [16 heads][width]
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < groups16; ++g) {
    __m512 rows[16], cols[16];
    for (int r = 0; r < 16; ++r) rows[r] = _mm512_loadu_ps(craw + g * 256 + 16 * r);
    qs_amx::transpose16(rows, cols);
    for (int64_t h = 0; h < heads; ++h)
      _mm512_storeu_ps(scores + h * width + 16 * g, _mm512_mul_ps(cols[h], vscale));
  }
  __m512 shift[16], total[16];
  for (int64_t h = 0; h < heads; ++h) {
    shift[h] = _mm512_set1_ps(max16(scores + h * width, len));
    total[h] = _mm512_setzero_ps();
  }
  // The weighted sum of V, 32 positions at a time: their P tiles (one a KV head) and V tiles
  // are built, then multiplied. Built for the whole context first (64 KB of tiles at 256
  // positions, past L1), the same took 1.2x as long (64 x 272-token contexts x 24 layers:
  // 10.5 -> 8.9 ms).
  for (int64_t t0 = 0; t0 < width; t0 += 32) {
    // P: weights exp(s - max), rows of the KV head's query heads (0 past the context)
    const __mmask16 live_lo = tail_mask(len - t0), live_hi = tail_mask(len - t0 - 16);
    for (int64_t h = 0; h < heads; ++h) {
      const float* sh = scores + h * width + t0;
      const __m512 lo = _mm512_maskz_mov_ps(
          live_lo, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live_lo, sh), shift[h])));
      const __m512 hi = _mm512_maskz_mov_ps(
          live_hi, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live_hi, sh + 16), shift[h])));
      total[h] = _mm512_add_ps(total[h], _mm512_add_ps(lo, hi));
      _mm512_storeu_si512(weights + (h / group) * TILE + 32 * h,
                          (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    // V: rows of positions 2r and 2r+1 interleaved (zeros past the context). The 32 positions
    // lie in one or two blocks: a row is its half's first row plus an offset.
    const uint16_t* half[2] = {row_of(v_cache, t0),
                               t0 + 16 < len ? row_of(v_cache, t0 + 16) : nullptr};
    const uint16_t* ahead[2] = {t0 + 32 < len ? row_of(v_cache, t0 + 32) : nullptr,
                                t0 + 48 < len ? row_of(v_cache, t0 + 48) : nullptr};
    int64_t lead_rows[2];  // the L2 lead's two groups, their rows spread over this row loop
    const uint16_t* lead[2] = {lead_group(groups16 + t0 / 16 + kL2Ahead, &lead_rows[0]),
                               lead_group(groups16 + t0 / 16 + kL2Ahead + 1, &lead_rows[1])};
    for (int r = 0; r < 16; ++r) {
      const int64_t i = (2 * r) % 16;
      const uint16_t* a = t0 + 2 * r < len ? half[r / 8] + i * slot_stride : nullptr;
      const uint16_t* b = t0 + 2 * r + 1 < len ? half[r / 8] + (i + 1) * slot_stride : nullptr;
      if (ahead[r / 8] != nullptr) {  // the next 32 positions' rows
        prefetch_lines(ahead[r / 8] + i * slot_stride, nkv * D);
        prefetch_lines(ahead[r / 8] + (i + 1) * slot_stride, nkv * D);
      }
      for (int64_t j = i; j < std::min<int64_t>(i + 2, lead_rows[r / 8]); ++j)
        prefetch_lines_l2(lead[r / 8] + j * slot_stride, nkv * D);
      for (int64_t j = 0; j < nkv; ++j)
        for (int c = 0; c < CH; ++c) {
          const __m512i x = a ? _mm512_loadu_si512(a + j * D + 32 * c) : _mm512_setzero_si512();
          const __m512i y = b ? _mm512_loadu_si512(b + j * D + 32 * c) : _mm512_setzero_si512();
          uint16_t* tile = vt + (j * DT + 2 * c) * TILE + 32 * r;
          _mm512_storeu_si512(tile, _mm512_unpacklo_epi16(x, y));
          _mm512_storeu_si512(tile + TILE, _mm512_unpackhi_epi16(x, y));
        }
    }
    // out += P . V, 64 dims (four C tiles) at a time; heads of 64 keep them over the context
    for (int64_t dt = 0; dt < DT; dt += 4) {
      if (t0 == 0) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
      } else if (DT > 4) {
        _tile_loadd(4, acc + 16 * dt, D * 4);
        _tile_loadd(5, acc + 16 * dt + 16, D * 4);
        _tile_loadd(6, acc + 16 * dt + 32, D * 4);
        _tile_loadd(7, acc + 16 * dt + 48, D * 4);
      }
      for (int64_t j = 0; j < nkv; ++j) {
        const uint16_t* vb = vt + (j * DT + dt) * TILE;
        _tile_loadd(0, weights + j * TILE, 64);
        _tile_loadd(1, vb, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, vb + TILE, 64);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, vb + 2 * TILE, 64);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, vb + 3 * TILE, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
      if (DT > 4 || t0 + 32 == width) {
        _tile_stored(4, acc + 16 * dt, D * 4);
        _tile_stored(5, acc + 16 * dt + 16, D * 4);
        _tile_stored(6, acc + 16 * dt + 32, D * 4);
        _tile_stored(7, acc + 16 * dt + 48, D * 4);
      }
    }
  }
  if (width == 0) std::memset(acc, 0, sizeof acc);  // no context: zeros, as the kernels above
  const __m512i undo_lo = _mm512_load_si512(UNDO_LO), undo_hi = _mm512_load_si512(UNDO_HI);
  for (int64_t h = 0; h < heads; ++h) {
    const float sum = _mm512_reduce_add_ps(total[h]);  // as softmax_rows: 0 for no context
    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
    for (int c = 0; c < CH; ++c) {
      const __m512 lo = _mm512_load_ps(acc + h * D + 32 * c);
      const __m512 hi = _mm512_load_ps(acc + h * D + 32 * c + 16);
      const __m512 d0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, undo_lo, hi), inv);
      const __m512 d1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, undo_hi, hi), inv);
      _mm512_storeu_si512(out + (first + h) * D + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(d1, d0));
    }
  }
}

// A sequence's KV heads h0 .. h1-1 in ranges of at most 16 query heads.
template <int CH>
void decode_seq(uint16_t* out, const uint16_t* q, const uint16_t* k_cache,
                const uint16_t* v_cache, const int64_t* table, int64_t len, int64_t hq,
                int64_t hkv, int64_t d, int64_t block_size, float scale, int64_t h0, int64_t h1) {
  const int64_t group = hq / hkv, per_range = 16 / group;
  for (int64_t a = h0; a < h1; a += per_range)
    decode_range<CH>(out, q, k_cache, v_cache, table, len, group, hkv, block_size, scale, a,
                     std::min(h1, a + per_range));
}

}  // namespace amx_decode
#endif  // QS_AMX

// Whether bf16 decodes may take the AMX kernel (tests and benchmarks turn it off to reach the
// vdpbf16ps one on the same machine).
bool use_amx = true;
// Whether fp32 decodes take the 16-lane kernel on AVX512 CPUs (benchmarks turn it off to
// compare with the generic one).
bool use_avx512_f32 = true;
int64_t AMX_MIN_GROUP = 2;  // query heads per KV head from which the AMX kernel runs

// The step's new tokens, written into their cache slots by the kernel before any sequence
// attends (all of them first, as the two index_copy_ calls did: tables may share blocks): row i
// of k / v (Hkv * D contiguous values, rows k_stride / v_stride apart) goes to slot slots[i].
// k == null: the caller wrote the cache.
template <typename T>
struct NewKV {
  const T* k;
  const T* v;
  int64_t k_stride, v_stride;
  const int64_t* slots;
};

template <typename T>
int decode_all(T* out, const T* q, int64_t q_stride, T* k_cache, T* v_cache,
               const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t n,
               int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
               NewKV<T> fresh) {
  if (d % W != 0 || hkv <= 0 || hq % hkv != 0) return 1;
  auto one = d == 64    ? decode_seq<T, 8>
              : d == 128 ? decode_seq<T, 16>
              : d == 256 ? decode_seq<T, 32>
                         : decode_seq<T, 0>;
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    if (use_avx512_f32) {
      if (d == 64) one = decode_seq16<F32Rows, 4>;
      if (d == 128) one = decode_seq16<F32Rows, 8>;
      if (d == 256) one = decode_seq16<F32Rows, 16>;
    }
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (sizeof(T) == 2) {
    if (d == 64) one = decode_seq16<Bf16Rows, 4>;
    if (d == 128) one = decode_seq16<Bf16Rows, 8>;
    if (d == 256) one = decode_seq16<Bf16Rows, 16>;
  }
#endif
  bool amx = false;  // the AMX kernel: each thread configures its tiles once a call
#if defined(QS_AMX)
  if constexpr (sizeof(T) == 2) {
    amx = use_amx && hq / hkv >= AMX_MIN_GROUP && hq / hkv <= 16 && block_size % 16 == 0 &&
          (d == 64 || d == 128 || d == 256) && qs_amx::permitted();
    if (amx)
      one = d == 64 ? amx_decode::decode_seq<2>
            : d == 128 ? amx_decode::decode_seq<4> : amx_decode::decode_seq<8>;
  }
#endif
  const int64_t slot_stride = hkv * d;
  // One task per sequence, all its KV heads: a block holds every head's rows side by side,
  // and the heads' tasks on different cores each pulled the whole block from memory (the
  // prefetchers fetch the neighbouring lines); in one task they are read once.
  // 64 x 264-token contexts x 24 layers from a DRAM-sized cache: 45.5 -> 34.8 ms, 2 threads.
  // With fewer sequences than threads (batch 1) that left cores idle: each sequence's KV heads
  // are then split into up to threads / n ranges, one task each.
  const int64_t threads = omp_get_max_threads();
  const int64_t parts = n < threads ? std::min(hkv, (threads + n - 1) / n) : 1;
#pragma omp parallel
  {
    if (fresh.k != nullptr) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(k_cache + fresh.slots[i] * slot_stride, fresh.k + i * fresh.k_stride,
                    slot_stride * sizeof(T));
        std::memcpy(v_cache + fresh.slots[i] * slot_stride, fresh.v + i * fresh.v_stride,
                    slot_stride * sizeof(T));
      }  // the loop's barrier: every new row is in place before any sequence reads
    }
#if defined(QS_AMX)
    if (amx) qs_amx::configure();  // this thread's tiles, for the call
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * parts; ++task) {
      const int64_t i = task / parts, part = task % parts;
      one(out + i * hq * d, q + i * q_stride, k_cache, v_cache, tables + i * table_width,
          lens[i], hq, hkv, d, block_size, scale, hkv * part / parts, hkv * (part + 1) / parts);
    }
#if defined(QS_AMX)
    if (amx) _tile_release();
#endif
  }
  return 0;
}

}  // namespace

extern "C" {

// Each returns 0, or 1 when the shape is not one it handles (head size not a multiple of 8).
// q rows are q_stride apart (Hq * D contiguous values each); k_new == null: no cache writes.
int paged_decode_f32(float* out, const float* q, int64_t q_stride, float* k_cache,
                     float* v_cache, const int64_t* tables, int64_t table_width,
                     const int64_t* lens, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                     int64_t block_size, float scale, const float* k_new, const float* v_new,
                     int64_t k_stride, int64_t v_stride, const int64_t* new_slots) {
  return decode_all(out, q, q_stride, k_cache, v_cache, tables, table_width, lens, n, hq, hkv, d,
                    block_size, scale, NewKV<float>{k_new, v_new, k_stride, v_stride, new_slots});
}

int paged_decode_bf16(uint16_t* out, const uint16_t* q, int64_t q_stride, uint16_t* k_cache,
                      uint16_t* v_cache, const int64_t* tables, int64_t table_width,
                      const int64_t* lens, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                      int64_t block_size, float scale, const uint16_t* k_new,
                      const uint16_t* v_new, int64_t k_stride, int64_t v_stride,
                      const int64_t* new_slots) {
  return decode_all(out, q, q_stride, k_cache, v_cache, tables, table_width, lens, n, hq, hkv, d,
                    block_size, scale,
                    NewKV<uint16_t>{k_new, v_new, k_stride, v_stride, new_slots});
}

// 1: bf16 decodes take the AMX kernel where the CPU and process have AMX (the default); 0: the
// vdpbf16ps one. Returns whether this build and process can run the AMX kernel at all.
int paged_decode_use_amx(int on, int64_t min_group) {
  use_amx = on != 0;
  if (min_group > 0) AMX_MIN_GROUP = min_group;
#if defined(QS_AMX)
  return qs_amx::permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// 1: fp32 decodes take the 16-lane kernel on AVX512 builds (the default); 0: the generic one.
// Returns whether this build has the 16-lane kernel.
int paged_decode_use_avx512_f32(int on) {
  use_avx512_f32 = on != 0;
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
