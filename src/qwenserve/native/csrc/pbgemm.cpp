// bf16 GEMM on AVX512-BF16 CPUs without AMX (AMD Zen 4/5), on a weight packed once:
//
//   y[m, n] = round_bf16(sum_k x[m, k] * w[n, k] + bias[n])          (fp32 sums)
//
// (the bias, bf16 or fp32, widened in the kernel: no conversion op before the call, so a
// recorded decode step replays it as it stands, worker/decode_replay.py)
//
// vdpbf16ps multiplies 16 pairs of bf16 and adds each pair's two products to one fp32 lane, so
// its packed operand holds 16 outputs x a pair of k: the weight is packed into panels of 64
// columns, [N / 64][K / 2][64][2] (the last panel and an odd K padded with zeros), and each
// step of the micro-kernel loads a k-pair's 4 panel vectors and broadcasts the pair of each of
// 6 rows of x: 24 accumulators, 24 vdpbf16ps per 4 loads + 6 broadcasts. On a 2-core Zen 5 with
// one weight hot in cache: 930-980 GFLOP/s at 16-2,048 rows (the cores' vdpbf16ps peak, ~930),
// oneDNN's packed kernel 630-740 at 64 rows and 820-880 at 512-2,048; over the model's weights
// read from memory: 1.1-1.25x oneDNN at 16-64 rows, level at 512 (docs/benchmarks.md, "A packed
// bf16 GEMM for AVX512-BF16 CPUs without AMX").
// The packed copy sits beside the model's plain weight, as oneDNN's did (cpu_packed_gemm.py).
//
// pbgemm_bf16_silu_mul is an MLP's gate_up projection with its SiLU-and-mul in the epilogue, on
// the same packed copy of w [2I, K] (I a multiple of 64: gate panel p and up panel I / 64 + p are
// whole panels): each row block's gate sums wait in fp32 in a small buffer while the up panel
// runs, then y = silu(gate) * up with elementwise.cpp's roundings (gate and up as the bf16 the
// GEMM would store, silu rounded to bf16, the product rounded once), so the result is the
// unfused path's bit for bit without its [M, 2I] intermediate and the pass over it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 64;  // output columns a panel (4 vectors of 16)
constexpr int64_t RB = 6;      // rows of x a micro-kernel call
constexpr int64_t ROW_CHUNK = 192;  // rows of x a task (a multiple of RB)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define QS_PBGEMM 1

// How a micro-kernel's sums leave: rounded to bf16 into y (the GEMM), in fp32 into a gate buffer
// [R][64] (a gate panel of the fused MLP), as silu(gate) * up with that buffer (its up panel), or
// into each row's running argmax (a greedy LM head).
enum Out { kStore, kGate, kSiluMul, kArgmax };

// Where a micro-kernel's rows leave (what OUT reads): y and its row stride; the gate buffer; the
// running argmax of its rows (per row 16 lanes: the largest bf16-rounded logit seen in the
// columns c with c % 16 == lane, and that column; a thread meets its columns in increasing
// order, so a strict comparison keeps the first of equal maxima, and NaN never compares larger)
// and the panel's first column.
struct Tail {
  uint16_t* y = nullptr;
  int64_t ldy = 0;
  float* gate = nullptr;
  float* best = nullptr;
  int32_t* column = nullptr;
  int64_t n0 = 0;
};

template <int R, Out OUT>
void micro(const uint16_t* x, int64_t ldx, const uint16_t* panel, const float* bias, int64_t K,
           int64_t cols, const uint16_t* ahead, int64_t ahead_lines, const Tail& out) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int n = 0; n < 4; ++n) acc[i][n] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  auto step = [&](const uint16_t* wk, const int32_t* xp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(wk);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(wk + 64);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[i]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, b2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], a, b3);
    }
  };
  for (int64_t kp = 0; kp < pairs; ++kp) {
    // ahead_lines 64-byte lines of the next panel into L2 a step (never faults past the end)
    for (int64_t j = 0; j < ahead_lines; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + (kp * ahead_lines + j) * 32),
                   _MM_HINT_T1);
    int32_t xp[R];
    for (int i = 0; i < R; ++i) std::memcpy(&xp[i], x + i * ldx + 2 * kp, sizeof(int32_t));
    step(panel + kp * 2 * PANEL, xp);
  }
  if (K % 2) {
    int32_t xp[R];
    for (int i = 0; i < R; ++i) xp[i] = x[i * ldx + K - 1];  // (x[K - 1], 0) as a pair
    step(panel + pairs * 2 * PANEL, xp);
  }
  __m512 b[4];
  for (int n = 0; n < 4; ++n) b[n] = bias ? _mm512_load_ps(bias + 16 * n) : _mm512_setzero_ps();
  // bit c: column c of the panel is live (the last panel's columns past N are not stored)
  const uint64_t live = cols >= PANEL ? ~uint64_t{0} : (uint64_t{1} << cols) - 1;
  if constexpr (OUT == kGate) {
    for (int i = 0; i < R; ++i)
      for (int n = 0; n < 4; ++n)
        _mm512_store_ps(out.gate + i * PANEL + 16 * n, _mm512_add_ps(acc[i][n], b[n]));
    return;
  }
  if constexpr (OUT == kArgmax) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int i = 0; i < R; ++i) {
      __m512 best = _mm512_loadu_ps(out.best + 16 * i);
      __m512i column = _mm512_loadu_si512(out.column + 16 * i);
      for (int n = 0; n < 4; ++n) {
        const __m512 v = bf16_round(_mm512_add_ps(acc[i][n], b[n]));
        const __mmask16 larger = static_cast<__mmask16>(live >> (16 * n)) &
                                 _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, larger, v);
        column = _mm512_mask_mov_epi32(
            column, larger, _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(out.n0 + 16 * n))));
      }
      _mm512_storeu_ps(out.best + 16 * i, best);
      _mm512_storeu_si512(out.column + 16 * i, column);
    }
    return;
  }
  if constexpr (OUT == kSiluMul) {  // acc becomes silu(gate) * up; the bias is in it after
    const uint16_t* table = silu_table_choice() ? silu_bf16_table() : nullptr;
    for (int i = 0; i < R; ++i)
      for (int n = 0; n < 4; ++n) {
        const __m512 g = _mm512_load_ps(out.gate + i * PANEL + 16 * n);
        const __m512 silu = table ? silu_bf16(table, g) : bf16_round(silu16(bf16_round(g)));
        acc[i][n] = _mm512_mul_ps(silu, bf16_round(_mm512_add_ps(acc[i][n], b[n])));
      }
    for (int n = 0; n < 4; ++n) b[n] = _mm512_setzero_ps();
  }
  const __mmask32 lo = static_cast<__mmask32>(live), hi = static_cast<__mmask32>(live >> 32);
  for (int i = 0; i < R; ++i) {
    const __m512i first = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(acc[i][1], b[1]),
                                                      _mm512_add_ps(acc[i][0], b[0]));
    const __m512i second = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(acc[i][3], b[3]),
                                                       _mm512_add_ps(acc[i][2], b[2]));
    _mm512_mask_storeu_epi16(out.y + i * out.ldy, lo, first);
    _mm512_mask_storeu_epi16(out.y + i * out.ldy + 32, hi, second);
  }
}

using Micro = void (*)(const uint16_t*, int64_t, const uint16_t*, const float*, int64_t,
                       int64_t, const uint16_t*, int64_t, const Tail&);
template <Out OUT>
constexpr Micro kMicro[RB] = {micro<1, OUT>, micro<2, OUT>, micro<3, OUT>,
                              micro<4, OUT>, micro<5, OUT>, micro<6, OUT>};

// Columns c0 .. c0 + 63 of a bias [N] (bf16 where bias_bf16, else fp32) in fp32, 0 past N.
void panel_bias(float* dst, const void* bias, int bias_bf16, int64_t c0, int64_t N) {
  for (int64_t c = 0; c < PANEL; ++c) {
    uint32_t bits = 0;
    if (c0 + c < N && bias_bf16)
      bits = uint32_t{static_cast<const uint16_t*>(bias)[c0 + c]} << 16;
    if (c0 + c < N && !bias_bf16) std::memcpy(&bits, static_cast<const float*>(bias) + c0 + c, 4);
    std::memcpy(&dst[c], &bits, 4);
  }
}

// Rows m0 .. m1-1 of x against a panel (and, fused, its up panel): the micro-kernel over 6-row
// blocks. The first row block reads the panel from memory and the rest from L2; at decode sizes
// that first pass ran at the read bandwidth, not the dot products' speed (a 64-row gate_up GEMM
// over weights from DRAM at ~70% of the peak), so the blocks fetch the thread's next panel
// (`next`, `next_up`; null: none) into L2 meanwhile: its 4 * pairs lines spread over the first
// blocks, up to 4 lines a k-pair step. `out`: the rows' tail from row m0 (y, best and column
// advance with the rows).
template <Out OUT>
void panel_rows(const uint16_t* x, int64_t ldx, const uint16_t* panel, const uint16_t* up_panel,
                const float* bias, const float* up_bias, int64_t m0, int64_t m1, int64_t K,
                int64_t cols, const uint16_t* next, const uint16_t* next_up, Tail out) {
  const int64_t pairs = (K + 1) / 2;
  const int64_t blocks = (m1 - m0 + RB - 1) / RB;
  const int64_t per_step = (4 + blocks - 1) / blocks;  // lines a step: 1, 2 or 4
  alignas(64) float gate[RB * PANEL];
  out.gate = gate;
  for (int64_t m = m0, blk = 0; m < m1; m += RB, ++blk) {
    const int64_t rows = std::min(RB, m1 - m), first_line = blk * per_step * pairs;
    const int64_t lines = first_line < 4 * pairs ? per_step : 0;
    const uint16_t* ahead = next ? next + first_line * 32 : nullptr;
    const uint16_t* xm = x + m * ldx;
    if constexpr (OUT == kSiluMul) {
      kMicro<kGate>[rows - 1](xm, ldx, panel, bias, K, cols, ahead, ahead ? lines : 0, out);
      const uint16_t* ahead_up = next_up ? next_up + first_line * 32 : nullptr;
      kMicro<kSiluMul>[rows - 1](xm, ldx, up_panel, up_bias, K, cols, ahead_up,
                                 ahead_up ? lines : 0, out);
    } else {
      kMicro<OUT>[rows - 1](xm, ldx, panel, bias, K, cols, ahead, ahead ? lines : 0, out);
    }
    if (out.y) out.y += RB * out.ldy;
    if (out.best) out.best += 16 * RB, out.column += 16 * RB;
  }
}

// A thread's running argmax state: [threads][M][16] lanes each (see Tail).
struct Running {
  std::vector<float> best;
  std::vector<int32_t> column;
};

// y [M, N] = x [M, K] . w^T (+ bias) from w's packed copy (kStore); y [M, N] = silu(gate) * up of
// w [2N, K], N % 64 == 0 (kSiluMul); or each thread's running argmax of the logits (kArgmax,
// into `running`). Tasks are (panel, chunk of rows), panel-major: a thread's consecutive tasks
// reuse its panel from L2, each panel is read from memory about once whatever the rows, and a
// thread's columns come in increasing order.
template <Out OUT>
void run(uint16_t* y, const uint16_t* x, int64_t ldx, const uint16_t* packed, const void* bias,
         int bias_bf16, int64_t M, int64_t N, int64_t K, Running* running = nullptr) {
  constexpr bool fused = OUT == kSiluMul;
  const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (K + 1) / 2;
  const int64_t panel_size = pairs * 2 * PANEL, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < panels * chunks; ++task) {
    const int64_t p = task / chunks, m0 = task % chunks * ROW_CHUNK;
    const int64_t m1 = std::min(M, m0 + ROW_CHUNK), cols = std::min(PANEL, N - p * PANEL);
    alignas(64) float b[2][PANEL];  // the panels' bias in fp32 (0 past N)
    if (bias) {
      panel_bias(b[0], bias, bias_bf16, p * PANEL, fused ? 2 * N : N);
      if (fused) panel_bias(b[1], bias, bias_bf16, N + p * PANEL, 2 * N);
    }
    const uint16_t* gate = packed + p * panel_size;  // (the panel itself where not fused)
    const uint16_t* up = fused ? gate + panels * panel_size : nullptr;
    const bool more = p + 1 < panels;  // the thread's next panel(s), if any, follow these
    Tail out;
    if constexpr (OUT == kArgmax) {
      const int64_t at = (omp_get_thread_num() * M + m0) * 16;
      out.best = running->best.data() + at, out.column = running->column.data() + at;
      out.n0 = p * PANEL;
    } else {
      out.y = y + m0 * N + p * PANEL, out.ldy = N;
    }
    panel_rows<OUT>(x, ldx, gate, up, bias ? b[0] : nullptr, bias ? b[1] : nullptr, m0, m1, K,
                    cols, more ? gate + panel_size : nullptr,
                    more && fused ? up + panel_size : nullptr, out);
  }
}
#endif

}  // namespace

extern "C" {

// 1 where this build runs the kernel (AVX512-BF16), else 0.
int pbgemm_available() {
#if defined(QS_PBGEMM)
  return 1;
#else
  return 0;
#endif
}

// bf16 elements of w [N, K]'s packed copy.
int64_t pbgemm_packed_size(int64_t N, int64_t K) {
  return (N + PANEL - 1) / PANEL * PANEL * ((K + 1) / 2 * 2);
}

// w [N, K] (contiguous) -> dst (pbgemm_packed_size elements): panel p, pair j, column c holds
// w[64 p + c, 2 j] and w[64 p + c, 2 j + 1]; columns past N and k past K are 0.
void pbgemm_pack(uint16_t* dst, const uint16_t* w, int64_t N, int64_t K) {
  const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* panel = dst + p * pairs * 2 * PANEL;
    for (int64_t c = 0; c < PANEL; ++c) {
      const int64_t n = p * PANEL + c;
      for (int64_t j = 0; j < pairs; ++j) {
        const int64_t k = 2 * j;
        panel[(j * PANEL + c) * 2] = n < N ? w[n * K + k] : 0;
        panel[(j * PANEL + c) * 2 + 1] = n < N && k + 1 < K ? w[n * K + k + 1] : 0;
      }
    }
  }
}

// x [M, K] (rows ldx apart), the packed weight of w [N, K], bias [N] (bf16 where bias_bf16,
// else fp32) or null -> y [M, N] bf16 (contiguous). 0 on success; 1: shapes not supported or no
// AVX512-BF16 in this build.
int pbgemm_bf16(uint16_t* y, const uint16_t* x, int64_t ldx, const uint16_t* packed,
                const void* bias, int bias_bf16, int64_t M, int64_t N, int64_t K) {
#if defined(QS_PBGEMM)
  if (M <= 0 || N <= 0 || K <= 0 || ldx < K) return 1;
  run<kStore>(y, x, ldx, packed, bias, bias_bf16, M, N, K);
  return 0;
#else
  (void)y, (void)x, (void)ldx, (void)packed, (void)bias, (void)bias_bf16, (void)M, (void)N,
      (void)K;
  return 1;
#endif
}

// An MLP's silu(x w_gate^T + b_gate) * (x w_up^T + b_up) from the packed weight of its merged
// w [2I, K] (I gate rows, then I up rows) and bias [2I] or null -> y [M, I] bf16, bit for bit
// pbgemm_bf16 followed by elementwise.cpp's silu_and_mul. 1: I not a multiple of 64 (a panel
// would hold gate and up columns), other shapes not supported, or no AVX512-BF16.
int pbgemm_bf16_silu_mul(uint16_t* y, const uint16_t* x, int64_t ldx, const uint16_t* packed,
                         const void* bias, int bias_bf16, int64_t M, int64_t I, int64_t K) {
#if defined(QS_PBGEMM)
  if (M <= 0 || I <= 0 || I % PANEL != 0 || K <= 0 || ldx < K) return 1;
  run<kSiluMul>(y, x, ldx, packed, bias, bias_bf16, M, I, K);
  return 0;
#else
  (void)y, (void)x, (void)ldx, (void)packed, (void)bias, (void)bias_bf16, (void)M, (void)I,
      (void)K;
  return 1;
#endif
}

// tokens [M] int64: each row's argmax over the columns of round_bf16(x w^T + bias), the first of
// equal maxima (torch.argmax of pbgemm_bf16's y; NaN logits are passed over, as in
// bgemm_bf16_argmax), without writing the [M, N] logits. x, packed, bias as pbgemm_bf16's.
int pbgemm_bf16_argmax(int64_t* tokens, const uint16_t* x, int64_t ldx, const uint16_t* packed,
                       const void* bias, int bias_bf16, int64_t M, int64_t N, int64_t K) {
#if defined(QS_PBGEMM)
  if (M <= 0 || N <= 0 || K <= 0 || ldx < K) return 1;
  const int64_t threads = omp_get_max_threads();
  static thread_local Running running;
  running.best.assign(threads * M * 16, -std::numeric_limits<float>::infinity());
  running.column.assign(threads * M * 16, 0);
  run<kArgmax>(nullptr, x, ldx, packed, bias, bias_bf16, M, N, K, &running);
  // threads hold increasing column ranges, each lane its columns in order: the largest value
  // wins, and among equal ones the lowest column
  for (int64_t m = 0; m < M; ++m) {
    float top = -std::numeric_limits<float>::infinity();
    int32_t at = 0;
    for (int64_t t = 0; t < threads; ++t)
      for (int64_t l = 0; l < 16; ++l) {
        const float v = running.best[(t * M + m) * 16 + l];
        const int32_t c = running.column[(t * M + m) * 16 + l];
        if (v > top || (v == top && c < at)) top = v, at = c;
      }
    tokens[m] = at;
  }
  return 0;
#else
  (void)tokens, (void)x, (void)ldx, (void)packed, (void)bias, (void)bias_bf16, (void)M, (void)N,
      (void)K;
  return 1;
#endif
}

}  // extern "C"
