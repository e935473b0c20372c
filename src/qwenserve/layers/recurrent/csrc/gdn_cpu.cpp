// Gated DeltaNet CPU kernels that PyTorch cannot express without extra passes over memory.
// Plain C++ with extern "C" entry points, loaded with ctypes (qwenserve.native.load_library).
//
// gdn_decode_f32: one token per sequence, the state updated in place in its pool slot. The
//   PyTorch form gathers each state out of the pool, reads it twice and scatters it back
//   (about five passes over 1 MiB per sequence and layer); here each (sequence, head) state is
//   read once for both products and rewritten once while it is still in L2.
// gdn_conv_{f32,bf16}: the depthwise causal conv over a varlen batch, history read from and
//   written back to the conv-state pool, without building the padded copy of the inputs.
// Maths and layouts as the reference (layers/recurrent/torch_ref.py, delta_rule.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

struct BF16 {  // bfloat16 as its bits; round to nearest even on the way out, as torch does
  using T = uint16_t;
  static float load(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

// x [T, D] rows of stride x_stride; weight_t [K, D] f32; bias [D] f32 or null;
// state [S, K-1, D]; qsl [R+1], slots [R]; has_init [R] (bytes); out [T, D] contiguous.
template <typename DT>
void conv(typename DT::T* out, const typename DT::T* x, int64_t x_stride, const float* weight_t,
          const float* bias, typename DT::T* state, const int64_t* qsl, const int64_t* slots,
          const uint8_t* has_init, int64_t R, int64_t D, int64_t K, int silu) {
  const int64_t hist = K - 1;
  constexpr int64_t kBlock = 256;  // channels per task: enough tasks for one long request
  const int64_t blocks = (D + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < R * blocks; ++task) {
    std::vector<float> win(K * kBlock), acc(kBlock);
    const int64_t r = task / blocks, c0 = (task % blocks) * kBlock;
    const int64_t nc = std::min(kBlock, D - c0), first = qsl[r], n = qsl[r + 1] - qsl[r];
    typename DT::T* st = state + slots[r] * hist * D + c0;
    for (int64_t j = 0; j < hist; ++j)  // win: the K most recent rows, oldest first
      for (int64_t c = 0; c < nc; ++c)
        win[j * kBlock + c] = has_init[r] ? DT::load(st[j * D + c]) : 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      const typename DT::T* xr = x + (first + t) * x_stride + c0;
      float* last = win.data() + hist * kBlock;
      for (int64_t c = 0; c < nc; ++c) last[c] = DT::load(xr[c]);
      for (int64_t c = 0; c < nc; ++c) acc[c] = bias ? bias[c0 + c] : 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        const float* w = weight_t + j * D + c0;
        const float* row = win.data() + j * kBlock;
        for (int64_t c = 0; c < nc; ++c) acc[c] += w[c] * row[c];
      }
      typename DT::T* yr = out + (first + t) * D + c0;
      for (int64_t c = 0; c < nc; ++c) {
        const float a = acc[c];
        yr[c] = DT::store(silu ? a / (1.0f + std::exp(-a)) : a);
      }
      for (int64_t j = 0; j < hist; ++j)  // shift: drop the oldest row
        std::copy(win.data() + (j + 1) * kBlock, win.data() + (j + 1) * kBlock + nc,
                  win.data() + j * kBlock);
    }
    // the new state: the last K-1 raw inputs (or the history when n < K-1), exactly
    for (int64_t j = 0; j < hist; ++j)
      for (int64_t c = 0; c < nc; ++c) st[j * D + c] = DT::store(win[j * kBlock + c]);
  }
}

}  // namespace

extern "C" {

// q, k [B, H, Dk] (l2-normalised, q scaled, heads repeated), v [B, H, Dv], g, beta [B, H]:
// contiguous f32. pool [S, H, Dk, Dv] f32; slots [B]; has_init [B] (bytes). out [B, H, Dv].
void gdn_decode_f32(float* out, float* pool, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, const int64_t* slots,
                    const uint8_t* has_init, int64_t B, int64_t H, int64_t Dk, int64_t Dv) {
#pragma omp parallel
  {
    std::vector<float> kv(Dv), qs(Dv), delta(Dv);
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < B * H; ++idx) {
      const int64_t b = idx / H, h = idx % H;
      float* S = pool + (slots[b] * H + h) * Dk * Dv;
      const float *qr = q + idx * Dk, *kr = k + idx * Dk, *vr = v + idx * Dv;
      float* o = out + idx * Dv;
      const float decay = std::exp(g[idx]), bt = beta[idx];
      if (!has_init[b]) std::fill(S, S + Dk * Dv, 0.0f);  // a fresh slot may hold NaN
      std::fill(kv.begin(), kv.end(), 0.0f);
      std::fill(qs.begin(), qs.end(), 0.0f);
      float kq = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        const float ki = kr[i], qi = qr[i];
        const float* row = S + i * Dv;
        kq += ki * qi;
        for (int64_t j = 0; j < Dv; ++j) {
          kv[j] += ki * row[j];
          qs[j] += qi * row[j];
        }
      }
      for (int64_t j = 0; j < Dv; ++j) {
        const float d = bt * (vr[j] - decay * kv[j]);
        delta[j] = d;
        o[j] = decay * qs[j] + kq * d;
      }
      for (int64_t i = 0; i < Dk; ++i) {
        const float ki = kr[i];
        float* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] = decay * row[j] + ki * delta[j];
      }
    }
  }
}

void gdn_conv_f32(float* out, const float* x, int64_t x_stride, const float* weight_t,
                  const float* bias, float* state, const int64_t* qsl, const int64_t* slots,
                  const uint8_t* has_init, int64_t R, int64_t D, int64_t K, int silu) {
  conv<F32>(out, x, x_stride, weight_t, bias, state, qsl, slots, has_init, R, D, K, silu);
}

void gdn_conv_bf16(uint16_t* out, const uint16_t* x, int64_t x_stride, const float* weight_t,
                   const float* bias, uint16_t* state, const int64_t* qsl, const int64_t* slots,
                   const uint8_t* has_init, int64_t R, int64_t D, int64_t K, int silu) {
  conv<BF16>(out, x, x_stride, weight_t, bias, state, qsl, slots, has_init, R, D, K, silu);
}

}  // extern "C"
