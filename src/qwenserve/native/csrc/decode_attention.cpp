// Paged decode attention on CPU: one query token per sequence, attending over its context
// where it lies in the paged KV cache (no gathered copy of K and V).
//
//   k_cache, v_cache [num_slots, Hkv, D]   slot of position p of sequence i:
//                                          tables[i * table_width + p / bs] * bs + p % bs
//   q, out           [n, Hq, D]            the G = Hq / Hkv query heads of KV head h are
//                                          rows h*G .. h*G+G-1 (grouped-query attention)
//
// One task per (sequence, KV head): the G query heads share every K and V row they read, so
// each row is loaded once. Scores are kept for the whole context (two passes: scores, then
// softmax-weighted V), in float32 whatever the cache dtype. Plain C++ over raw pointers
// (called through ctypes): it builds in seconds and needs no torch headers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    *dst = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *dst = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
void decode_one(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t len, int64_t h, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                float scale) {
  const int64_t group = hq / hkv, slot_stride = hkv * d;
  std::vector<float> qf(group * d), scores(group * len), acc(group * d, 0.f);
  std::vector<float> row(d);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < d; ++j) qf[g * d + j] = load(q[(h * group + g) * d + j]) * scale;
  for (int64_t p = 0; p < len; ++p) {
    const T* k = k_cache + (table[p / block_size] * block_size + p % block_size) * slot_stride +
                 h * d;
    for (int64_t j = 0; j < d; ++j) row[j] = load(k[j]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < d; ++j) s += row[j] * qg[j];
      scores[g * len + p] = s;
    }
  }
  std::vector<float> inv(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * len;
    float mx = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < len; ++p) mx = sg[p] > mx ? sg[p] : mx;
    for (int64_t p = 0; p < len; ++p) {
      sg[p] = std::exp(sg[p] - mx);
      total += sg[p];
    }
    inv[g] = total > 0.f ? 1.f / total : 0.f;
  }
  for (int64_t p = 0; p < len; ++p) {
    const T* v = v_cache + (table[p / block_size] * block_size + p % block_size) * slot_stride +
                 h * d;
    for (int64_t j = 0; j < d; ++j) row[j] = load(v[j]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * len + p];
      float* a = acc.data() + g * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) a[j] += w * row[j];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < d; ++j) store(out + (h * group + g) * d + j, acc[g * d + j] * inv[g]);
}

template <typename T>
void decode_all(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                int64_t table_width, const int64_t* lens, int64_t n, int64_t hq, int64_t hkv,
                int64_t d, int64_t block_size, float scale) {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < hkv; ++h)
      decode_one(out + i * hq * d, q + i * hq * d, k_cache, v_cache, tables + i * table_width,
                 lens[i], h, hq, hkv, d, block_size, scale);
}

}  // namespace

extern "C" {

void paged_decode_f32(float* out, const float* q, const float* k_cache, const float* v_cache,
                      const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t n,
                      int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale) {
  decode_all(out, q, k_cache, v_cache, tables, table_width, lens, n, hq, hkv, d, block_size,
             scale);
}

void paged_decode_bf16(uint16_t* out, const uint16_t* q, const uint16_t* k_cache,
                       const uint16_t* v_cache, const int64_t* tables, int64_t table_width,
                       const int64_t* lens, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                       int64_t block_size, float scale) {
  decode_all(out, q, k_cache, v_cache, tables, table_width, lens, n, hq, hkv, d, block_size,
             scale);
}

}  // extern "C"
