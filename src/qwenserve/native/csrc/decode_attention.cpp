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
// softmax-weighted V), in float32 whatever the cache dtype. Rows are handled as vectors of 8
// floats (GCC vector extensions: AVX2 where the machine has it, SSE pairs elsewhere); the G dot
// products of a row are independent chains, so they overlap in the core. Plain C++ over raw
// pointers, called through ctypes: it builds in seconds and needs no torch headers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t W = 8;  // floats per v8

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN (a bit test: -ffast-math drops isnan)
    *dst = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *dst = static_cast<uint16_t>(bits >> 16);
}

inline void load_row(v8* dst, const float* src, int64_t chunks) {
  std::memcpy(dst, src, chunks * sizeof(v8));
}
inline void load_row(v8* dst, const uint16_t* src, int64_t chunks) {
  float* f = reinterpret_cast<float*>(dst);
  for (int64_t j = 0; j < chunks * W; ++j) f[j] = to_float(src[j]);
}

inline float hsum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// D % 8 == 0 (checked by the caller): rows are D / 8 vectors.
template <typename T>
void decode_one(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t len, int64_t h, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                float scale) {
  const int64_t group = hq / hkv, slot_stride = hkv * d, chunks = d / W;
  std::vector<v8> qv(group * chunks), acc(group * chunks, v8{}), row(chunks);
  std::vector<float> scores(group * len), inv(group);
  float* qf = reinterpret_cast<float*>(qv.data());
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < d; ++j) qf[g * d + j] = to_float(q[(h * group + g) * d + j]) * scale;

  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t base = table[b] * block_size, count = std::min(block_size, len - start);
    for (int64_t t = 0; t < count; ++t) {
      load_row(row.data(), k_cache + (base + t) * slot_stride + h * d, chunks);
      for (int64_t g = 0; g < group; ++g) {
        const v8* qg = qv.data() + g * chunks;
        v8 s{};
        for (int64_t c = 0; c < chunks; ++c) s += row[c] * qg[c];
        scores[g * len + start + t] = hsum(s);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * len;
    float mx = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < len; ++p) mx = std::max(mx, sg[p]);
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      sg[p] = std::exp(sg[p] - mx);
      total += sg[p];
    }
    inv[g] = total > 0.f ? 1.f / total : 0.f;
  }
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t base = table[b] * block_size, count = std::min(block_size, len - start);
    for (int64_t t = 0; t < count; ++t) {
      load_row(row.data(), v_cache + (base + t) * slot_stride + h * d, chunks);
      for (int64_t g = 0; g < group; ++g) {
        const float w = scores[g * len + start + t];
        v8* a = acc.data() + g * chunks;
        for (int64_t c = 0; c < chunks; ++c) a[c] += w * row[c];
      }
    }
  }
  const float* af = reinterpret_cast<const float*>(acc.data());
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < d; ++j) store(out + (h * group + g) * d + j, af[g * d + j] * inv[g]);
}

template <typename T>
int decode_all(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
               int64_t table_width, const int64_t* lens, int64_t n, int64_t hq, int64_t hkv,
               int64_t d, int64_t block_size, float scale) {
  if (d % W != 0 || hkv <= 0 || hq % hkv != 0) return 1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < hkv; ++h)
      decode_one(out + i * hq * d, q + i * hq * d, k_cache, v_cache, tables + i * table_width,
                 lens[i], h, hq, hkv, d, block_size, scale);
  return 0;
}

}  // namespace

extern "C" {

// Each returns 0, or 1 when the shape is not one it handles (head size not a multiple of 8).
int paged_decode_f32(float* out, const float* q, const float* k_cache, const float* v_cache,
                     const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t n,
                     int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale) {
  return decode_all(out, q, k_cache, v_cache, tables, table_width, lens, n, hq, hkv, d,
                    block_size, scale);
}

int paged_decode_bf16(uint16_t* out, const uint16_t* q, const uint16_t* k_cache,
                      const uint16_t* v_cache, const int64_t* tables, int64_t table_width,
                      const int64_t* lens, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                      int64_t block_size, float scale) {
  return decode_all(out, q, k_cache, v_cache, tables, table_width, lens, n, hq, hkv, d,
                    block_size, scale);
}

}  // extern "C"
