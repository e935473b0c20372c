// Gated DeltaNet CPU kernels that PyTorch cannot express without extra passes over memory.
//
// decode_step: one token per sequence, the state updated in place in its pool slot. The
//   PyTorch form gathers each state out of the pool, reads it twice and scatters it back
//   (about five passes over 1 MiB per sequence and layer); here each (sequence, head) state is
//   read once for both products and rewritten once while it is still in L2.
// causal_conv1d: the depthwise causal conv over a varlen batch, history read from and written
//   back to the conv-state pool, without building the padded copy of the inputs.
// Maths and layouts as the reference (layers/recurrent/torch_ref.py, delta_rule.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 tensor");
}

}  // namespace

// q, k [B, H, Dk] (l2-normalised, q scaled, heads repeated), v [B, H, Dv], g, beta [B, H],
// all float32; pool [S, H, Dk, Dv] float32; slots [B] int64; has_init [B] bool.
// Returns o [B, H, Dv] float32; pool[slots[b]] holds the new states.
torch::Tensor decode_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                          torch::Tensor beta, torch::Tensor pool, torch::Tensor slots,
                          torch::Tensor has_init) {
  check_f32(q, "q"); check_f32(k, "k"); check_f32(v, "v"); check_f32(g, "g");
  check_f32(beta, "beta"); check_f32(pool, "pool");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && has_init.scalar_type() == torch::kBool);
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2);
  TORCH_CHECK(pool.size(1) == H && pool.size(2) == Dk && pool.size(3) == Dv, "pool shape");
  auto slots_c = slots.contiguous();
  auto init_c = has_init.contiguous();
  auto o = torch::empty({B, H, Dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const bool* ip = init_c.data_ptr<bool>();
  float* pp = pool.data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kv(Dv), qs(Dv), delta(Dv);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / H, h = idx % H;
      float* S = pp + (sp[b] * H + h) * Dk * Dv;
      const float *qr = qp + idx * Dk, *kr = kp + idx * Dk, *vr = vp + idx * Dv;
      float* out = op + idx * Dv;
      const float decay = std::exp(gp[idx]), bt = bp[idx];
      if (!ip[b]) std::fill(S, S + Dk * Dv, 0.0f);  // a fresh slot may hold anything, even NaN
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
        out[j] = decay * qs[j] + kq * d;
      }
      for (int64_t i = 0; i < Dk; ++i) {
        const float ki = kr[i];
        float* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] = decay * row[j] + ki * delta[j];
      }
    }
  });
  return o;
}

// x [T, D]; weight_t [K, D] float32 (the conv weight transposed); bias [D] float32 or empty;
// state [S, K-1, D] in x's dtype; qsl [R+1], slots [R] int64; has_init [R] bool.
// Returns act(conv(x)) [T, D] in x's dtype (accumulated in float32); state updated in place.
template <typename scalar_t>
void conv_impl(const torch::Tensor& x, const torch::Tensor& weight_t, const torch::Tensor& bias,
               torch::Tensor& state, const torch::Tensor& qsl, const torch::Tensor& slots,
               const torch::Tensor& has_init, bool silu, torch::Tensor& out) {
  const int64_t D = x.size(1), K = weight_t.size(0), hist = K - 1, R = slots.size(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* yp = out.data_ptr<scalar_t>();
  scalar_t* stp = state.data_ptr<scalar_t>();
  const float* wp = weight_t.data_ptr<float>();
  const float* biasp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t* qp = qsl.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* ip = has_init.data_ptr<bool>();
  constexpr int64_t kBlock = 256;  // channels per task: enough tasks for one long request
  const int64_t blocks = (D + kBlock - 1) / kBlock;
  at::parallel_for(0, R * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> win(K * kBlock), acc(kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / blocks, c0 = (task % blocks) * kBlock;
      const int64_t nc = std::min(kBlock, D - c0), first = qp[r], n = qp[r + 1] - qp[r];
      scalar_t* st = stp + sp[r] * hist * D + c0;
      // win holds the K most recent rows (ring-free: shifted each token; K is small)
      for (int64_t j = 0; j < hist; ++j)
        for (int64_t c = 0; c < nc; ++c)
          win[j * kBlock + c] = ip[r] ? static_cast<float>(st[j * D + c]) : 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* xr = xp + (first + t) * D + c0;
        float* last = win.data() + hist * kBlock;
        for (int64_t c = 0; c < nc; ++c) last[c] = static_cast<float>(xr[c]);
        for (int64_t c = 0; c < nc; ++c) acc[c] = biasp ? biasp[c0 + c] : 0.0f;
        for (int64_t j = 0; j < K; ++j) {
          const float* w = wp + j * D + c0;
          const float* row = win.data() + j * kBlock;
          for (int64_t c = 0; c < nc; ++c) acc[c] += w[c] * row[c];
        }
        scalar_t* yr = yp + (first + t) * D + c0;
        for (int64_t c = 0; c < nc; ++c) {
          const float a = acc[c];
          yr[c] = static_cast<scalar_t>(silu ? a / (1.0f + std::exp(-a)) : a);
        }
        for (int64_t j = 0; j < hist; ++j)  // shift: drop the oldest row
          std::copy(win.data() + (j + 1) * kBlock, win.data() + (j + 1) * kBlock + nc,
                    win.data() + j * kBlock);
      }
      // the new state is the last K-1 rows: the raw inputs (or the history for n < K-1),
      // stored in x's dtype, which win holds exactly
      for (int64_t j = 0; j < hist; ++j)
        for (int64_t c = 0; c < nc; ++c) st[j * D + c] = static_cast<scalar_t>(win[j * kBlock + c]);
    }
  });
}

torch::Tensor causal_conv1d(torch::Tensor x, torch::Tensor weight_t, torch::Tensor bias,
                            torch::Tensor state, torch::Tensor qsl, torch::Tensor slots,
                            torch::Tensor has_init, bool silu) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, D] with contiguous rows");
  x = x.contiguous();
  check_f32(weight_t, "weight_t");
  TORCH_CHECK(state.scalar_type() == x.scalar_type() && state.is_contiguous(),
              "state must be contiguous, in x's dtype");
  TORCH_CHECK(weight_t.size(1) == x.size(1) && state.size(2) == x.size(1), "conv dims");
  TORCH_CHECK(state.size(1) == weight_t.size(0) - 1, "state holds K-1 rows");
  auto qsl_c = qsl.to(torch::kInt64).contiguous();
  auto slots_c = slots.to(torch::kInt64).contiguous();
  auto init_c = has_init.to(torch::kBool).contiguous();
  auto bias_c = bias.numel() ? bias.to(torch::kFloat32).contiguous() : bias;
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv1d", [&] {
    conv_impl<scalar_t>(x, weight_t, bias_c, state, qsl_c, slots_c, init_c, silu, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "gated delta rule, one token per sequence, in place");
  m.def("causal_conv1d", &causal_conv1d, "varlen depthwise causal conv with state pool");
}
