// Intel AMX tile helpers shared by the kernels that use the tiles (prefill attention, bf16 GEMM).
// QS_AMX is defined where the build has AMX-BF16 and AVX512-BF16; the tile helpers exist only
// then (the tile shape and transpose16 wherever the build has AVX-512).
#pragma once

#include <cstdint>
#include <cstdlib>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QS_AMX 1
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

// The tile shape and the 16 x 16 transpose are plain AVX-512: the vdpbf16ps prefill kernel
// (AVX512-BF16 CPUs without AMX) packs its operands in the tiles' layout with them too.
namespace qs_amx {

constexpr int64_t ROWS = 16;        // tile rows
constexpr int64_t TILE = 16 * 32;   // bf16 elements of a 16 x 64-byte tile

// rows[i] (16 x 32-bit each) -> cols[j][i] = rows[i][j]: a 16 x 16 transpose of 32-bit words.
inline void transpose16(const __m512* rows, __m512* cols) {
  __m512 a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks
    a[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    a[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4
    for (int j = 0; j < 2; ++j) {
      const __m512d x = _mm512_castps_pd(a[i + j]), y = _mm512_castps_pd(a[i + j + 2]);
      b[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      b[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  for (int i = 0; i < 16; i += 8) {  // 8 x 8: 128-bit lanes
    for (int j = 0; j < 4; ++j) {
      a[i + j] = _mm512_shuffle_f32x4(b[i + j], b[i + j + 4], 0x88);
      a[i + j + 4] = _mm512_shuffle_f32x4(b[i + j], b[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {  // 16 x 16: 256-bit halves
    cols[j] = _mm512_shuffle_f32x4(a[j], a[j + 8], 0x88);
    cols[j + 8] = _mm512_shuffle_f32x4(a[j], a[j + 8], 0xdd);
  }
}

}  // namespace qs_amx
#endif  // __AVX512F__

#if defined(QS_AMX)
namespace qs_amx {

// Whether this process may use the tiles (Linux grants them per process, on request).
inline bool permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// All eight tiles as 16 rows x 64 bytes, set on each thread of a call (oneDNN's GEMMs set their
// own configuration in between).
inline void configure() {
  struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = ROWS;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Packed B operands of a call: grows with the largest call, kept by the calling thread (its
// OpenMP team shares it).
template <typename T>
struct Buffer {
  T* data = nullptr;
  int64_t size = 0;
  T* get(int64_t n) {
    if (n > size) {
      std::free(data);
      data = static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
      size = data ? n : 0;
    }
    return data;
  }
  ~Buffer() { std::free(data); }
};

// Rows m0 .. m0+15 of x (rows ldx bytes apart), bytes 64s .. 64s+63 of each -> one B tile: the
// 16 x 16 transpose of their 32-bit words (a row of x per column; k pairs of bf16 or k quads of
// int8 as tile rows). Rows past M are zero.
inline void pack_b_tile(void* dst, const void* x, int64_t ldx, int64_t m0, int64_t M, int64_t s) {
  const char* bytes = static_cast<const char*>(x);
  __m512 rows[16], cols[16];
  for (int64_t i = 0; i < 16; ++i)
    rows[i] = m0 + i < M ? _mm512_loadu_ps(bytes + (m0 + i) * ldx + 64 * s) : _mm512_setzero_ps();
  transpose16(rows, cols);
  float* tile = static_cast<float*>(dst);
  for (int r = 0; r < 16; ++r) _mm512_store_ps(tile + 16 * r, cols[r]);
}

}  // namespace qs_amx
#endif  // QS_AMX
