// speclm: RMS normalization of float32 rows in one pass, for eager steps on the CPU.
//
// y = x * rsqrt(mean(x^2) + eps) * (w + offset) over the last dimension: transformers' RMSNorm
// (offset 0: Llama, Qwen, SmolLM; offset 1: Gemma's 1 + w) as one call. Eagerly, transformers
// runs it as six to eight ATen calls of a few hundred floats each (cast, pow, mean, add, rsqrt,
// two products), and a decoding step of a small model runs over a hundred norms: on a 2-core CPU
// that overhead was 10-15% of a drafted step. The same roundings are written out (the product
// x * r first, then the weight; the weight plus its offset rounded to float32 first); only the
// sum of squares runs in another order (16 lanes, then a fixed tree), which does not depend on
// how many rows share the call: a row has the same bits alone or in a batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

namespace {

constexpr int kLanes = 16;

float sum_of_squares(const float* x, int64_t n) {
  float lane[kLanes] = {};
  const int64_t vec = n - n % kLanes;
  for (int64_t k = 0; k < vec; k += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += x[k + j] * x[k + j];  // lanes independent: vectorized
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  float s = lane[0];
  for (int64_t k = vec; k < n; ++k) s += x[k] * x[k];
  return s;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm is float32");
  TORCH_CHECK(w.dim() == 1 && x.dim() >= 1 && x.size(-1) == w.size(0), "rms_norm: x [..., H], w [H]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t H = wc.size(0), rows = H ? xc.numel() / H : 0;
  at::Tensor y = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  // a step's rows are a few thousand floats: threads cost more than they save below ~64k
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(H, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* yr = yp + r * H;
      const float mean = sum_of_squares(xr, H) / static_cast<float>(H);
      const float inv = 1.0f / std::sqrt(mean + e);
      for (int64_t k = 0; k < H; ++k) yr[k] = (xr[k] * inv) * (wp[k] + o);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speclm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
}
TORCH_LIBRARY_IMPL(speclm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
