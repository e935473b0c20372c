// Causal prefill attention of one sequence's chunk (bf16), for the CPU backend's prefill spans in
// place of PyTorch's flash kernel: on Intel AMX tiles, 1.3-1.75x its speed on a 2-core Xeon for
// 256-4,096-token prompts and head sizes 64-256; on AVX512-BF16 CPUs without AMX (AMD Zen 4/5),
// the same products as vdpbf16ps dot products, where PyTorch's kernel runs its products through
// MKL's generic fp32 path (docs/benchmarks.md).
//
//   q   [L, Hq, D]   rows q_stride apart, heads contiguous; query i sits at position S - L + i
//   k,v [S, Hkv, D]  rows k_stride / v_stride apart (the chunk's context, its own tokens last)
//   out [L, Hq, D]   rows out_stride apart
//
// Per KV head, K is packed once into AMX's B layout for scores = Q . K^T (16 tokens x 32 dims
// a tile, dim pairs as rows) and V into its B layout for P . V (32 tokens x 16 dims a tile, token
// pairs interleaved); every query head of the group and every 16-row query block reuses them.
// A tile row is also what vdpbf16ps takes as its packed operand (16 outputs x a pair), so the
// route without AMX reads the same buffers, broadcasting a pair of the other operand per step.
// A task is (KV head, query head of its group, 16 query rows): scores over the keys the block
// can see (fp32), an exact two-pass softmax per row in fp32 (masked keys excluded), P
// rounded to bf16 for the product (as flash kernels do), the sums scaled by 1 / row sum and
// rounded to bf16. Needs D % 32 == 0, Hq % Hkv == 0 and scale > 0; returns 1 (the caller keeps
// its own kernel) where the shapes or the machine do not fit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define QS_BF16_DOT 1
using qs_amx::ROWS;
using qs_amx::TILE;
using qs_amx::transpose16;

// K of one head as B tiles of Q . K^T: tile (t, c) row r holds, for tokens n = 16t .. 16t+15,
// the pair of dims (32c + 2r, 32c + 2r + 1): the transpose of the tokens' 32-dim rows taken as
// 16 words each. Tokens past S are zero.
void pack_k(uint16_t* dst, const uint16_t* k, int64_t k_stride, int64_t S, int64_t D) {
  const int64_t tiles = (S + ROWS - 1) / ROWS, dcs = D / 32;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t c = 0; c < dcs; ++c) {
      __m512 rows[16], cols[16];
      for (int64_t n = 0; n < ROWS; ++n) {
        const int64_t tok = ROWS * t + n;
        rows[n] = tok < S ? _mm512_loadu_ps(k + tok * k_stride + 32 * c) : _mm512_setzero_ps();
      }
      transpose16(rows, cols);
      float* tile = reinterpret_cast<float*>(dst + (t * dcs + c) * TILE);
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(tile + 16 * r, cols[r]);
    }
}

// V of one head as B tiles of P . V: tile (t, c) row r holds, for dims n = 16c .. 16c+15, the
// values of tokens 32t + 2r and 32t + 2r + 1 side by side; tokens past S are zero.
void pack_v(uint16_t* dst, const uint16_t* v, int64_t v_stride, int64_t S, int64_t D) {
  const int64_t tiles = (S + 31) / 32, dts = D / 16;
  alignas(64) static const uint16_t order[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                 37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t tok = 32 * t + 2 * r;
      const uint16_t* even = tok < S ? v + tok * v_stride : nullptr;
      const uint16_t* odd = tok + 1 < S ? v + (tok + 1) * v_stride : nullptr;
      for (int64_t c = 0; c < dts; ++c) {
        const __m512i a = even ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(even + 16 * c)))
                               : _mm512_setzero_si512();
        const __m512i b = odd ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(odd + 16 * c)))
                              : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + (t * dts + c) * TILE + 32 * r,
                            _mm512_permutex2var_epi16(a, interleave, b));
      }
    }
}

#if defined(QS_AMX)
// Tile C += Q . K^T of one key tile kb (DCS chunks of 32 dims; query tiles in 2.., B its K
// tile). A macro: the tile intrinsics take their tile numbers as literal tokens.
#define QS_KEY_TILE_SCORES(DCS, C, B, kb)          \
  do {                                             \
    _tile_loadd(B, (kb), 64);                      \
    _tile_dpbf16ps(C, 2, B);                       \
    if constexpr ((DCS) > 1) {                     \
      _tile_loadd(B, (kb) + TILE, 64);             \
      _tile_dpbf16ps(C, 3, B);                     \
    }                                              \
    if constexpr ((DCS) > 2) {                     \
      _tile_loadd(B, (kb) + 2 * TILE, 64);         \
      _tile_dpbf16ps(C, 4, B);                     \
    }                                              \
    if constexpr ((DCS) > 3) {                     \
      _tile_loadd(B, (kb) + 3 * TILE, 64);         \
      _tile_dpbf16ps(C, 5, B);                     \
    }                                              \
  } while (0)

// Scores of 16 query rows against every key tile, the DCS query tiles (32 dims each) held in
// tiles 2.. for the whole pass; two key tiles at a time into tiles 0 and 1 (B tiles 6 and 7).
template <int DCS>
void scores_resident(float* scores, const uint16_t* qrows, const uint16_t* kt, int64_t ktiles,
                     int64_t width) {
  constexpr int64_t D = 32 * DCS;
  _tile_loadd(2, qrows, D * sizeof(uint16_t));
  if constexpr (DCS > 1) _tile_loadd(3, qrows + 32, D * sizeof(uint16_t));
  if constexpr (DCS > 2) _tile_loadd(4, qrows + 64, D * sizeof(uint16_t));
  if constexpr (DCS > 3) _tile_loadd(5, qrows + 96, D * sizeof(uint16_t));
  int64_t t = 0;
  for (; t + 2 <= ktiles; t += 2) {
    _tile_zero(0);
    _tile_zero(1);
    QS_KEY_TILE_SCORES(DCS, 0, 6, kt + t * DCS * TILE);
    QS_KEY_TILE_SCORES(DCS, 1, 7, kt + (t + 1) * DCS * TILE);
    _tile_stored(0, scores + ROWS * t, width * sizeof(float));
    _tile_stored(1, scores + ROWS * (t + 1), width * sizeof(float));
  }
  if (t < ktiles) {
    _tile_zero(0);
    QS_KEY_TILE_SCORES(DCS, 0, 6, kt + t * DCS * TILE);
    _tile_stored(0, scores + ROWS * t, width * sizeof(float));
  }
}

// P . V for NC (2 or 4) output tiles of 16 dims from dim tile c0: the sums in tiles 0..NC-1,
// each 32-token slice of P loaded once into tile 4 for all of them (V tiles in 5 and 6).
template <int NC>
void values_group(float* sums, const uint16_t* probs, const uint16_t* vt, int64_t c0,
                  int64_t dts, int64_t width) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NC > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < width / 32; ++t) {
    const uint16_t* vb = vt + (t * dts + c0) * TILE;
    _tile_loadd(4, probs + 32 * t, width * sizeof(uint16_t));
    _tile_loadd(5, vb, 64);
    _tile_loadd(6, vb + TILE, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (NC > 2) {
      _tile_loadd(5, vb + 2 * TILE, 64);
      _tile_loadd(6, vb + 3 * TILE, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, sums, 64 * sizeof(float));
  _tile_stored(1, sums + 16, 64 * sizeof(float));
  if constexpr (NC > 2) {
    _tile_stored(2, sums + 32, 64 * sizeof(float));
    _tile_stored(3, sums + 48, 64 * sizeof(float));
  }
}

#endif  // QS_AMX

// acc[i][n] = sum over segments g < segs and pairs r < 16 of a's pair (row i, 32 g + 2 r) times
// b's tile row (g, n, r): b + g * seg_stride + n * tile_stride + 32 r holds 16 outputs' pairs.
// RB rows of a (lda apart) and NT outputs of 16 lanes, stored as fp32 to out + i * ldo + 16 n.
// Scores: a = Q's rows, a segment = 32 dims, a tile = 16 keys; values: a = P's rows, a
// segment = 32 tokens, a tile = 16 dims.
template <int RB, int NT>
void dot_block(float* out, int64_t ldo, const uint16_t* a, int64_t lda, const uint16_t* b,
               int64_t seg_stride, int64_t tile_stride, int64_t segs) {
  __m512 acc[RB][NT];
  for (int i = 0; i < RB; ++i)
    for (int n = 0; n < NT; ++n) acc[i][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < segs; ++g) {
    const uint16_t* bg = b + g * seg_stride;
    const uint16_t* ag = a + 32 * g;
    for (int r = 0; r < 16; ++r) {
      __m512bh bv[NT];
      for (int n = 0; n < NT; ++n)
        bv[n] = (__m512bh)_mm512_loadu_si512(bg + n * tile_stride + 32 * r);
      for (int i = 0; i < RB; ++i) {
        int32_t pair;
        std::memcpy(&pair, ag + i * lda + 2 * r, sizeof pair);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        for (int n = 0; n < NT; ++n) acc[i][n] = _mm512_dpbf16_ps(acc[i][n], av, bv[n]);
      }
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int n = 0; n < NT; ++n) _mm512_storeu_ps(out + i * ldo + 16 * n, acc[i][n]);
}

// dot_block over rows 0 .. rows-1 of a (in fours: a has rows rounded up to 4, zero or unused
// past rows) and `tiles` outputs of 16 lanes, four at a time: each group of four output tiles
// (a few KB of b) stays in L1 while every row group meets it.
void dot_product(float* out, int64_t ldo, const uint16_t* a, int64_t lda, int64_t rows,
                 const uint16_t* b, int64_t seg_stride, int64_t tile_stride, int64_t tiles,
                 int64_t segs) {
  constexpr int RB = 4;
  for (int64_t n = 0; n < tiles; n += 4) {
    const uint16_t* bn = b + n * tile_stride;
    for (int64_t i = 0; i < rows; i += RB) {
      float* o = out + i * ldo + 16 * n;
      const uint16_t* ai = a + i * lda;
      switch (std::min<int64_t>(4, tiles - n)) {
        case 4: dot_block<RB, 4>(o, ldo, ai, lda, bn, seg_stride, tile_stride, segs); break;
        case 3: dot_block<RB, 3>(o, ldo, ai, lda, bn, seg_stride, tile_stride, segs); break;
        case 2: dot_block<RB, 2>(o, ldo, ai, lda, bn, seg_stride, tile_stride, segs); break;
        default: dot_block<RB, 1>(o, ldo, ai, lda, bn, seg_stride, tile_stride, segs);
      }
    }
  }
}

struct Scratch {  // one thread's buffers, kept between calls
  std::vector<float> scores, inv, sums;
  std::vector<uint16_t> probs, qrows;
};

// One task: rows (<= 16) query rows of one head, the first at position first_pos; the products
// on AMX tiles (kAmx) or as vdpbf16ps dot products.
template <bool kAmx>
void attend_rows(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride,
                 int64_t rows, int64_t first_pos, const uint16_t* kt, const uint16_t* vt,
                 int64_t S, int64_t D, float scale, Scratch& s) {
  const int64_t dcs = D / 32, dts = D / 16;
  const int64_t keys = std::min(S, first_pos + rows);  // the last row sees keys 0 .. keys-1
  const int64_t ktiles = (keys + ROWS - 1) / ROWS, width = (keys + 31) / 32 * 32;
  uint16_t* qrows = s.qrows.data();
  for (int64_t r = 0; r < ROWS; ++r) {  // A tiles of the scores: the rows, zero-padded
    if (r < rows)
      std::memcpy(qrows + r * D, q + r * q_stride, D * sizeof(uint16_t));
    else
      std::memset(qrows + r * D, 0, D * sizeof(uint16_t));
  }
  float* scores = s.scores.data();  // [16, width]
  if constexpr (!kAmx) {  // segments: 32 dims of a key tile; outputs: key tiles of 16
    dot_product(scores, width, qrows, D, rows, kt, TILE, dcs * TILE, ktiles, dcs);
  } else {
#if defined(QS_AMX)
  switch (dcs) {
    case 1: scores_resident<1>(scores, qrows, kt, ktiles, width); break;
    case 2: scores_resident<2>(scores, qrows, kt, ktiles, width); break;
    case 3: scores_resident<3>(scores, qrows, kt, ktiles, width); break;
    case 4: scores_resident<4>(scores, qrows, kt, ktiles, width); break;
    default:  // D > 128: the query tiles are loaded again for each key tile
      for (int64_t t = 0; t < ktiles; ++t) {
        _tile_zero(0);
        for (int64_t c = 0; c < dcs; ++c) {
          _tile_loadd(2, qrows + 32 * c, D * sizeof(uint16_t));
          _tile_loadd(6, kt + (t * dcs + c) * TILE, 64);
          _tile_dpbf16ps(0, 2, 6);
        }
        _tile_stored(0, scores + ROWS * t, width * sizeof(float));
      }
  }
#endif
  }
  uint16_t* probs = s.probs.data();  // [16, width] bf16: P, zero past each row's last key
  float* inv = s.inv.data();
  for (int64_t r = 0; r < ROWS; ++r) {
    uint16_t* pr = probs + r * width;
    const int64_t n = r < rows ? std::min(first_pos + r + 1, keys) : 0;  // keys row r sees
    float* sr = scores + r * width;
    float total = 0.f;
    if (n > 0) {  // scale > 0: the largest scaled score is the scaled largest score
      const __m512 mx = _mm512_set1_ps(max16(sr, n)), vscale = _mm512_set1_ps(scale);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 valid = tail_mask(n - i);
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sr + i), mx),
                                       vscale);
        const __m512 p = _mm512_maskz_mov_ps(valid, exp16(x));
        sum = _mm512_add_ps(sum, p);
        _mm256_mask_storeu_epi16(pr + i, valid, (__m256i)_mm512_cvtneps_pbh(p));
      }
      total = _mm512_reduce_add_ps(sum);
    }
    std::fill(pr + n, pr + width, uint16_t{0});
    inv[r] = total > 0.f ? 1.f / total : 0.f;
  }
  float* sums = s.sums.data();  // [16, 64]: up to four output tiles
  for (int64_t c = 0; c < dts; c += 4) {
    const int64_t group = std::min<int64_t>(4, dts - c);  // dts is even: 4 or 2
    if constexpr (!kAmx) {  // segments: 32 tokens; outputs: dim tiles of 16
      dot_product(sums, 64, probs, width, rows, vt + c * TILE, dts * TILE, TILE, group,
                  width / 32);
    } else {
#if defined(QS_AMX)
      if (group == 4)
        values_group<4>(sums, probs, vt, c, dts, width);
      else
        values_group<2>(sums, probs, vt, c, dts, width);
#endif
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 ir = _mm512_set1_ps(inv[r]);
      for (int64_t n = 0; n < group; ++n)  // 16 dims at a time, rounded to bf16 (nearest even)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(out + r * out_stride + 16 * (c + n)),
            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sums + r * 64 + 16 * n), ir)));
    }
  }
}

// Whether calls take the AMX tiles: where the build has them and the process may use them,
// unless prefill_attention_use_amx turned them off.
bool amx_enabled = true;

bool use_amx() {
#if defined(QS_AMX)
  return amx_enabled && qs_amx::permitted();
#else
  return false;
#endif
}

template <bool kAmx>
void attend_all(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride,
                const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                int64_t L, int64_t S, int64_t hq, int64_t hkv, int64_t d, float scale) {
  const int64_t group = hq / hkv, dcs = d / 32, dts = d / 16;
  const int64_t k_elems = (S + ROWS - 1) / ROWS * dcs * TILE, v_elems = (S + 31) / 32 * dts * TILE;
  // every element is written by pack_k / pack_v (padding included): no zeroing of the buffer
  std::unique_ptr<uint16_t[]> packed(new uint16_t[hkv * (k_elems + v_elems)]);
  const int64_t blocks = (L + ROWS - 1) / ROWS, width = (S + 31) / 32 * 32;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < 2 * hkv; ++i) {
      uint16_t* dst = packed.get() + (i / 2) * (k_elems + v_elems);
      if (i % 2 == 0)
        pack_k(dst, k + (i / 2) * d, k_stride, S, d);
      else
        pack_v(dst + k_elems, v + (i / 2) * d, v_stride, S, d);
    }  // the loop's barrier: every head is packed before any task reads it
    static thread_local Scratch scratch;
    scratch.scores.resize(ROWS * width), scratch.inv.resize(ROWS), scratch.sums.resize(ROWS * 64);
    scratch.probs.resize(ROWS * width), scratch.qrows.resize(ROWS * d);
#if defined(QS_AMX)
    if constexpr (kAmx) qs_amx::configure();
#endif
    // the last query blocks see the most keys: they go first, so the dynamic schedule ends on
    // short tasks
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < hkv * group * blocks; ++task) {
      const int64_t head = task / blocks, b = blocks - 1 - task % blocks;
      const int64_t h = head / group, r0 = b * ROWS;
      const uint16_t* kt = packed.get() + h * (k_elems + v_elems);
      attend_rows<kAmx>(out + r0 * out_stride + head * d, out_stride,
                        q + r0 * q_stride + head * d, q_stride, std::min(ROWS, L - r0),
                        S - L + r0, kt, kt + k_elems, S, d, scale, scratch);
    }
#if defined(QS_AMX)
    if constexpr (kAmx) _tile_release();
#endif
  }
}
#endif  // QS_BF16_DOT

}  // namespace

extern "C" {

// 1 where this build runs the kernel (AVX512-BF16; AMX tiles where the process may use them).
int prefill_attention_available() {
#if defined(QS_BF16_DOT)
  return 1;
#else
  return 0;
#endif
}

// Whether calls take the AMX tiles (on, the default where they run) or vdpbf16ps (off): a switch
// for tests and benchmarks, process-wide. Returns 1 where the AMX route can run here at all.
int prefill_attention_use_amx(int on) {
#if defined(QS_BF16_DOT)
  amx_enabled = on != 0;
#else
  (void)on;
#endif
#if defined(QS_AMX)
  return qs_amx::permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// 0 on success; 1: shapes or machine not supported (nothing written).
int prefill_attention_bf16(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride,
                           const uint16_t* k, int64_t k_stride, const uint16_t* v,
                           int64_t v_stride, int64_t L, int64_t S, int64_t hq, int64_t hkv,
                           int64_t d, float scale) {
#if defined(QS_BF16_DOT)
  if (d <= 0 || d % 32 != 0 || hkv <= 0 || hq % hkv != 0 || L <= 0 || L > S || !(scale > 0.f))
    return 1;
  if (use_amx())
    attend_all<true>(out, out_stride, q, q_stride, k, k_stride, v, v_stride, L, S, hq, hkv, d,
                     scale);
  else
    attend_all<false>(out, out_stride, q, q_stride, k, k_stride, v, v_stride, L, S, hq, hkv, d,
                      scale);
  return 0;
#else
  (void)out, (void)out_stride, (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v;
  (void)v_stride, (void)L, (void)S, (void)hq, (void)hkv, (void)d, (void)scale;
  return 1;
#endif
}

}  // extern "C"
