// The sampler's draw on CPU: greedy argmax, or temperature + min_p + top_k + top_p and one
// draw per row, reading each row of logits a few times in place.
//
// PyTorch's reference (worker/sampler.py) clones the logits, divides by the temperature, sorts
// every row for top_k/top_p, takes a softmax and draws an Exp(1) variate per vocabulary entry:
// at 64 rows of a 152k vocabulary that is 0.5-4.6 s per decode step on a 2-core CPU, more than
// the model's forward pass. Here one draw is an inverse-CDF search with a single uniform per row
// (given by the caller from the request's generator, so seeded requests stay reproducible), and
// truncation selects candidates instead of sorting the vocabulary:
//
//   delta_j = (x_j - max x) / T                  (so exp(delta_j) is p_j up to one factor)
//   min_p   keeps delta_j >= log(min_p)          (p_j >= min_p * p_max, as the reference)
//   top_k   keeps the k largest x_j, ties with the k-th included (as the reference's mask)
//   top_p   keeps, in descending order, each entry whose preceding mass is < top_p of the
//           mass left by min_p and top_k (the reference's ascending cumsum <= 1 - top_p drop)
//
// Without top_k/top_p no candidate list is built: the row's exp-sum, then a walk to u * sum.
// top_p without top_k finds its nucleus through a histogram of the scaled logits (top_p_draw):
// only the entries of the bin where the cut falls are ordered.
// Plain C++ over raw pointers, called through ctypes (see decode_attention.cpp); built with the
// FAST_MATH flags so the reductions vectorise; exp_approx (vec_math.h) vectorises with them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 256;  // entries per partial sum of the walk

struct Candidate {
  float value;
  int64_t index;
};

// 32 running maxima (four vectors, independent chains: a single max chain waits on its latency).
float row_max(const float* x, int64_t n) {
  constexpr int64_t kLanes = 32;
  float acc[kLanes];
  for (float& a : acc) a = kNegInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = acc[l] > x[j + l] ? acc[l] : x[j + l];
  float m = kNegInf;
  for (; j < n; ++j) m = m > x[j] ? m : x[j];
  for (float a : acc) m = m > a ? m : a;
  return m;
}

// The first maximum, as torch.argmax, in one pass over memory: block maxima, then the index
// inside the (cache-resident) block that holds the first of them.
int64_t argmax(const float* x, int64_t n) {
  float best = kNegInf;
  int64_t block = -1;
  for (int64_t b = 0; b < n; b += kBlock) {
    const float m = row_max(x + b, std::min(kBlock, n - b));
    if (m > best) best = m, block = b;
  }
  if (block < 0) return 0;  // every entry -inf or NaN
  for (int64_t j = block;; ++j)
    if (x[j] == best) return j;
}

inline float weight(float x, float m, float scale, float cut) {
  const float d = (x - m) * scale;
  return d >= cut ? exp_approx(d) : 0.f;
}

// Which entries count: all of them, or (top_p_draw) those of a nucleus.
struct KeepAll {
  bool operator()(int64_t, float) const { return true; }
};

// The weights of entries first .. first + n - 1 that keep(index, value) counts.
template <typename Keep>
float kept_mass(const float* x, int64_t first, int64_t n, float m, float scale, float cut,
                Keep keep) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = first; j < first + n; ++j)
    s += keep(j, x[j]) ? weight(x[j], m, scale, cut) : 0.f;
  return s;
}

float block_mass(const float* x, int64_t n, float m, float scale, float cut) {
  return kept_mass(x, 0, n, m, scale, cut, KeepAll{});
}

double row_mass(const float* x, int64_t n, float m, float scale, float cut) {
  double total = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) total += block_mass(x + b, std::min(kBlock, n - b), m, scale, cut);
  return total;
}

// The entry where the running mass of the entries keep() counts first passes ``target``:
// block masses (``mass``, or computed here) locate the block, and the walk inside it adds the
// entries' weights.
template <typename Keep = KeepAll>
int64_t walk_to(const float* x, int64_t n, float m, float scale, float cut, double target,
                const double* mass, Keep keep = {}) {
  double cum = 0.0;
  for (int64_t b = 0, i = 0; b < n; b += kBlock, ++i) {
    const int64_t len = std::min(kBlock, n - b);
    const double block = mass ? mass[i] : kept_mass(x, b, len, m, scale, cut, keep);
    if (cum + block > target) {
      double walk = cum;
      for (int64_t j = 0; j < len; ++j) {
        const float w = keep(b + j, x[b + j]) ? weight(x[b + j], m, scale, cut) : 0.f;
        walk += w;
        if (w > 0.f && walk > target) return b + j;
      }
    }
    cum += block;  // rounding let the walk miss: go on with the block's sum
  }
  return argmax(x, n);
}

// The entry where the running mass first passes u * total, over the whole row. Two passes over
// memory: the mass, then a walk to the block that holds the target.
int64_t draw_row(const float* x, int64_t n, float m, float scale, float cut, double u) {
  const double target = u * row_mass(x, n, m, scale, cut);
  return walk_to(x, n, m, scale, cut, target, nullptr);
}

// Without min_p: one pass over memory. Each block's maximum and its exp-sum relative to it
// (the second loop reads the block from L1), then the row's mass from those, and the walk
// re-reads only the block that holds the target.
int64_t draw_row_one_pass(const float* x, int64_t n, float scale, double u) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<float> block_max(blocks), block_sum(blocks);
  float m = kNegInf;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t b = i * kBlock, len = std::min(kBlock, n - b);
    const float bm = row_max(x + b, len);
    block_max[i] = bm;
    block_sum[i] = bm > kNegInf ? block_mass(x + b, len, bm, scale, kNegInf) : 0.f;
    m = std::max(m, bm);
  }
  if (!(m > kNegInf)) return argmax(x, n);
  std::vector<double> mass(blocks);
  double total = 0.0;
  for (int64_t i = 0; i < blocks; ++i) {
    mass[i] = block_sum[i] > 0.f ? block_sum[i] * static_cast<double>(exp_approx((block_max[i] - m) * scale)) : 0.0;
    total += mass[i];
  }
  return walk_to(x, n, m, scale, kNegInf, u * total, mass.data());
}

bool descending(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// The k largest entries (k < n) and every entry equal to the k-th, in descending order.
std::vector<Candidate> top_k_candidates(const float* x, int64_t n, int64_t k) {
  std::vector<Candidate> heap;  // a min-heap on value of the k largest seen so far
  heap.reserve(k);
  auto greater = [](const Candidate& a, const Candidate& b) { return a.value > b.value; };
  for (int64_t j = 0; j < n; ++j) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back({x[j], j});
      std::push_heap(heap.begin(), heap.end(), greater);
    } else if (x[j] > heap.front().value) {
      std::pop_heap(heap.begin(), heap.end(), greater);
      heap.back() = {x[j], j};
      std::push_heap(heap.begin(), heap.end(), greater);
    }
  }
  const float kth = heap.front().value;
  std::vector<Candidate> out;
  out.reserve(k);
  for (int64_t j = 0; j < n; ++j)
    if (x[j] >= kth) out.push_back({x[j], j});
  std::sort(out.begin(), out.end(), descending);
  return out;
}

// top_p without top_k: the nucleus found through a histogram of delta over [-kRange, 0] (every
// entry below in the last bin) instead of ordering candidates, which for a flat row (a
// random-weight model, or temperature 1 over a wide vocabulary) meant ordering most of it: 64
// rows of a 248k vocabulary took 240 ms. One pass takes each entry's weight into its bin;
// the bins above the one where the kept mass reaches top_p * mass are kept whole; that bin's
// entries are ordered (value descending, then index, as the reference's sort) and kept while
// the mass before them is < top_p * mass. The draw then walks the row in index order over the
// kept entries (a distribution-preserving order: the kept set and weights are the reference's).
constexpr int64_t kBins = 4096;
constexpr float kRange = 32.f;  // e^-32: 1.3e-14 of the maximum's weight

inline int64_t bin_of(float d) {  // d <= 0
  const float b = -d * (static_cast<float>(kBins - 1) / kRange);
  return b < static_cast<float>(kBins - 1) ? static_cast<int64_t>(b) : kBins - 1;
}

int64_t top_p_draw(const float* x, int64_t n, float m, float scale, float cut, float top_p,
                   double u) {
  static thread_local std::vector<double> bins;
  bins.assign(kBins, 0.0);
  alignas(64) float w[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) w[j] = weight(x[b + j], m, scale, cut);
    for (int64_t j = 0; j < len; ++j)
      if (w[j] > 0.f) bins[bin_of((x[b + j] - m) * scale)] += w[j];
  }
  double mass = 0.0;
  for (double v : bins) mass += v;
  const double bound = static_cast<double>(top_p) * mass;
  int64_t edge = -1;    // the bin where the preceding mass reaches bound
  double before = 0.0;  // the mass of the bins above it: all kept
  for (int64_t i = 0; i < kBins && edge < 0; ++i) {
    if (before + bins[i] >= bound)
      edge = i;
    else
      before += bins[i];
  }
  if (edge < 0) return draw_row(x, n, m, scale, cut, u);  // rounding: keep every entry
  std::vector<Candidate> c;  // the edge bin's entries (weight > 0), ordered
  for (int64_t j = 0; j < n; ++j) {
    const float d = (x[j] - m) * scale;  // (below the last bin's top, only weights > 0 count)
    if (d >= cut && bin_of(d) == edge && (edge < kBins - 1 || weight(x[j], m, scale, cut) > 0.f))
      c.push_back({x[j], j});
  }
  std::sort(c.begin(), c.end(), descending);
  size_t keep = 0;  // the first always (the mass before it, the bins above, is < bound)
  while (keep < c.size() && (keep == 0 || before < bound))
    before += exp_approx((c[keep++].value - m) * scale);
  // Kept: the entries ranked up to the edge bin's last kept one (value, then index), i.e. the
  // bins above whole and that bin's first `keep`.
  const float last = c[keep - 1].value;
  const int64_t last_index = c[keep - 1].index;
  return walk_to(x, n, m, scale, cut, u * before, nullptr, [&](int64_t j, float v) {
    return v > last || (v == last && j <= last_index);
  });
}

// How many of the descending candidates top_p keeps, given the mass they are a share of; 0
// when the candidates end before the preceding mass reaches top_p (more entries are needed).
size_t nucleus_size(const std::vector<Candidate>& c, float m, float scale, double mass, float top_p) {
  const double bound = static_cast<double>(top_p) * mass;
  double before = 0.0;
  for (size_t i = 0; i < c.size(); ++i) {
    if (i > 0 && before >= bound) return i;
    before += exp_approx((c[i].value - m) * scale);
  }
  return before >= bound ? c.size() : 0;
}

int64_t draw_candidates(const std::vector<Candidate>& c, size_t keep, float m, float scale, double u) {
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += exp_approx((c[i].value - m) * scale);
  const double target = u * total;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += exp_approx((c[i].value - m) * scale);
    if (cum > target) return c[i].index;
  }
  return c[0].index;
}

int64_t sample_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p,
                   float min_p, double u) {
  if (temperature <= 0.f) return argmax(x, n);
  const float scale = 1.f / temperature;
  const bool truncate_k = top_k > 0 && top_k < n;
  if (!truncate_k && top_p >= 1.f && min_p <= 0.f) return draw_row_one_pass(x, n, scale, u);
  const float m = row_max(x, n);
  if (!(m > kNegInf)) return argmax(x, n);  // every entry masked (or NaN)
  const float cut = min_p > 0.f ? logf(min_p) : kNegInf;
  if (!truncate_k && top_p >= 1.f) return draw_row(x, n, m, scale, cut, u);

  std::vector<Candidate> c;
  double mass;  // the mass top_p is a share of: what min_p and top_k leave
  if (truncate_k) {
    c = top_k_candidates(x, n, top_k);
    c.erase(std::remove_if(c.begin(), c.end(),
                           [&](const Candidate& e) { return (e.value - m) * scale < cut; }),
            c.end());
    if (c.empty()) return argmax(x, n);  // only when min_p's cut passes the maximum (min_p > 1)
    mass = 0.0;
    for (const Candidate& e : c) mass += exp_approx((e.value - m) * scale);
    const size_t keep = top_p < 1.f ? nucleus_size(c, m, scale, mass, top_p) : c.size();
    return draw_candidates(c, keep ? keep : c.size(), m, scale, u);
  }
  return top_p_draw(x, n, m, scale, cut, top_p, u);
}

// fn(r, row) for each of `rows` rows on the threads, row the fp32 values of logits row
// row_of(r): fp32 rows are read in place, bf16 rows (the LM head's own dtype) widened exactly
// (to_float) into a per-thread buffer that stays in cache, where the caller's `logits.float()`
// wrote a whole [rows, vocab] fp32 copy to memory (64 x 151,936 logits: 4 ms a decode step).
template <typename T, typename RowOf, typename Fn>
void for_rows(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride, RowOf row_of,
              Fn fn) {
#pragma omp parallel
  {
    const FlushSubnormals ftz;
    std::vector<float> widened(std::is_same_v<T, float> ? 0 : vocab);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = logits + row_of(r) * row_stride;
      if constexpr (std::is_same_v<T, float>) {
        fn(r, src);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < vocab; ++j) widened[j] = to_float(src[j]);
        fn(r, widened.data());
      }
    }
  }
}

// One draw per row.
template <typename T>
int sample_rows(int64_t* out, const T* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                const float* temperature, const int64_t* top_k, const float* top_p,
                const float* min_p, const double* uniform) {
  if (rows < 0 || vocab <= 0 || (row_stride != 0 && row_stride < vocab)) return 1;
  for_rows(logits, rows, vocab, row_stride, [](int64_t r) { return r; },
           [&](int64_t r, const float* row) {
             out[r] = sample_row(row, vocab, temperature[r], top_k[r], top_p[r], min_p[r],
                                 uniform[r]);
           });
  return 0;
}

// The raw logits' log-probabilities a response reports, without a [rows, vocab] log_softmax:
// per row the log of its exp-sum (lp_j = (x_j - max) - log sum), the chosen token's lp and
// rank (1 + the entries with a larger logit), and the k largest (value descending, then token
// id). Two passes over the row plus the top-k scan.
void logprob_row(const float* x, int64_t n, int64_t chosen, int64_t k, float* chosen_lp,
                 int64_t* rank, float* top_lp, int64_t* top_id) {
  const float m = row_max(x, n);
  const float log_sum = static_cast<float>(std::log(row_mass(x, n, m, 1.f, kNegInf)));
  auto lp = [&](float v) { return (v - m) - log_sum; };
  // the rank counts larger logits: the same order as the log-probabilities', and exact (a
  // recomputed lp of the chosen token could differ in its last bit under the reassociating
  // flags this library is built with, and count itself)
  const float xc = x[chosen];
  int64_t above = 0;
#pragma omp simd reduction(+ : above)
  for (int64_t j = 0; j < n; ++j) above += x[j] > xc ? 1 : 0;
  *chosen_lp = lp(xc);
  *rank = above + 1;
  if (k <= 0) return;
  // The k largest in one scan against the current k-th (top_k_candidates' heap pass and its
  // second pass for the ties cost ~2 ms more a 64-row step of a 152k vocabulary): descending,
  // ties by index, as that function orders them.
  std::vector<Candidate> best;
  best.reserve(k + 1);
  for (int64_t j = 0; j < n; ++j) {
    if (static_cast<int64_t>(best.size()) == k && !(x[j] > best.back().value)) continue;
    const Candidate e{x[j], j};
    best.insert(std::upper_bound(best.begin(), best.end(), e, descending), e);
    if (static_cast<int64_t>(best.size()) > k) best.pop_back();
  }
  for (int64_t i = 0; i < k; ++i) {
    const bool listed = i < static_cast<int64_t>(best.size());
    top_lp[i] = listed ? lp(best[i].value) : kNegInf;  // (k > vocab: padding)
    top_id[i] = listed ? best[i].index : -1;
  }
}

template <typename T>
int logprob_rows(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                 const int64_t* row_index, const int64_t* chosen, int64_t k, float* chosen_lp,
                 int64_t* rank, float* top_lp, int64_t* top_id) {
  if (rows < 0 || vocab <= 0 || row_stride < vocab || k < 0) return 1;
  for (int64_t r = 0; r < rows; ++r)
    if (chosen[r] < 0 || chosen[r] >= vocab) return 1;
  for_rows(logits, rows, vocab, row_stride, [&](int64_t r) { return row_index[r]; },
           [&](int64_t r, const float* row) {
             logprob_row(row, vocab, chosen[r], k, chosen_lp + r, rank + r, top_lp + r * k,
                         top_id + r * k);
           });
  return 0;
}

}  // namespace

extern "C" {

// out [rows] int64; logits [rows, vocab] fp32 / bf16 rows `row_stride` apart (0: one row for
// all); per row: temperature (0: greedy), top_k (0: off), top_p (1: off), min_p (0: off) and a
// uniform u in [0, 1).
int sample_rows_f32(int64_t* out, const float* logits, int64_t rows, int64_t vocab,
                    int64_t row_stride, const float* temperature, const int64_t* top_k,
                    const float* top_p, const float* min_p, const double* uniform) {
  return sample_rows(out, logits, rows, vocab, row_stride, temperature, top_k, top_p, min_p,
                     uniform);
}

int sample_rows_bf16(int64_t* out, const uint16_t* logits, int64_t rows, int64_t vocab,
                     int64_t row_stride, const float* temperature, const int64_t* top_k,
                     const float* top_p, const float* min_p, const double* uniform) {
  return sample_rows(out, logits, rows, vocab, row_stride, temperature, top_k, top_p, min_p,
                     uniform);
}

// Per row r (logits row row_index[r]): chosen_lp[r] and rank[r] of token chosen[r], and the k
// largest log-probabilities in top_lp / top_id [rows, k]. 1: bad arguments (nothing written).
int logprob_rows_f32(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                     const int64_t* row_index, const int64_t* chosen, int64_t k,
                     float* chosen_lp, int64_t* rank, float* top_lp, int64_t* top_id) {
  return logprob_rows(logits, rows, vocab, row_stride, row_index, chosen, k, chosen_lp, rank,
                      top_lp, top_id);
}

int logprob_rows_bf16(const uint16_t* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                      const int64_t* row_index, const int64_t* chosen, int64_t k,
                      float* chosen_lp, int64_t* rank, float* top_lp, int64_t* top_id) {
  return logprob_rows(logits, rows, vocab, row_stride, row_index, chosen, k, chosen_lp, rank,
                      top_lp, top_id);
}

}  // extern "C"
