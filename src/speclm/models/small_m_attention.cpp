// speclm: attention of a few query rows over a key/value cache, float32, for CPUs with AVX2+FMA.
//
// A decoding step or a verify asks attention for 1 to a few dozen query rows over a cache of
// hundreds of slots. PyTorch's SDPA, traced into a compiled step over a static cache, reads the
// cache's whole capacity under a mask, and with grouped-query heads copies every shared key/value
// head for each query head that reads it. Here each (row, query head) reads its key/value head in
// place and only the slots its mask lets it see, so the cost follows the filled length.
//
// Every (batch row, head, query row) is computed on its own in one fixed order (scores over the
// visible slots in ascending order, the maximum, the exponentials summed in slot order, the
// values accumulated in slot order), so a query row's output has the same bits whether it is
// alone in a step or among others in a verify.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

#include "small_m.h"

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const int64_t d_vec = D - D % 16;
  for (int64_t d = 0; d < d_vec; d += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
  }
  float s = speclm::reduce(lo, hi);
  for (int64_t d = d_vec; d < D; ++d) s += a[d] * b[d];
  return s;
}

// out[D] += p * v[D]
inline void axpy(float p, const float* v, float* out, int64_t D) {
  const __m256 pv = _mm256_set1_ps(p);
  const int64_t d_vec = D - D % 8;
  for (int64_t d = 0; d < d_vec; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(out + d)));
  for (int64_t d = d_vec; d < D; ++d) out[d] += p * v[d];
}

// query [B, H, T, D], key/value [B, H_kv, L, D] (any strides, the last one 1), mask [B | 1, 1, T, L]:
// additive float32 (a slot at the lowest float or -inf is not seen), bool (true: seen), or none
// (causal, the T queries being the cache's last T slots) -> [B, T, H, D].
at::Tensor small_m_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "small_m_attention runs on the CPU");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
              value.scalar_type() == at::kFloat, "small_m_attention is float32");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes(),
              "small_m_attention: query [B, H, T, D], key and value [B, H_kv, L, D]");
  const int64_t B = query.size(0), H = query.size(1), T = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), L = key.size(2);
  TORCH_CHECK(key.size(0) == B && key.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "small_m_attention: key/value must match the query's batch and head size, and divide its heads");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "small_m_attention: the head dimension must be contiguous");
  const float* mp = nullptr;  // an additive mask
  const bool* mb = nullptr;   // a boolean one: true where seen
  int64_t ms0 = 0, ms2 = 0, ms3 = 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK((m.scalar_type() == at::kFloat || m.scalar_type() == at::kBool) && m.dim() == 4 &&
                (m.size(0) == B || m.size(0) == 1) && m.size(1) == 1 && m.size(2) == T && m.size(3) == L,
                "small_m_attention: mask is float32 or bool [B or 1, 1, T, L]");
    if (m.scalar_type() == at::kFloat) mp = m.data_ptr<float>();
    else mb = m.data_ptr<bool>();
    ms0 = m.size(0) == 1 ? 0 : m.stride(0);
    ms2 = m.stride(2);
    ms3 = m.stride(3);
  } else {
    TORCH_CHECK(T <= L, "small_m_attention: without a mask the queries are the cache's last slots");
  }
  const bool masked = mp != nullptr || mb != nullptr;
  const int64_t group = H / Hkv;
  const float lowest = std::numeric_limits<float>::lowest();
  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  at::Tensor out = at::empty({B, T, H, D}, query.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * H * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score(L);
    std::vector<int64_t> seen(L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * T), h = (i / T) % H, t = i % T, g = h / group;
      const float* q = qp + b * query.stride(0) + h * query.stride(1) + t * query.stride(2);
      const float* k = kp + b * key.stride(0) + g * key.stride(1);
      const float* v = vp + b * value.stride(0) + g * value.stride(1);
      const float* mrow = mp == nullptr ? nullptr : mp + b * ms0 + t * ms2;
      const bool* brow = mb == nullptr ? nullptr : mb + b * ms0 + t * ms2;
      const int64_t end = masked ? L : L - T + t + 1;  // slots [0, end) may be seen
      int64_t n = 0;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < end; ++s) {
        float bias = 0.0f;
        if (mrow != nullptr) {
          bias = mrow[s * ms3];
          if (!(bias > lowest)) continue;  // masked (also -inf)
        } else if (brow != nullptr && !brow[s * ms3]) {
          continue;
        }
        const float x = dot(q, k + s * key.stride(2), D) * sc + bias;
        score[n] = x;
        seen[n++] = s;
        top = std::max(top, x);
      }
      float* o = op + ((b * T + t) * H + h) * D;
      std::fill(o, o + D, 0.0f);
      if (n == 0) continue;  // nothing visible: zeros
      float total = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float e = std::exp(score[j] - top);
        total += e;
        axpy(e, v + seen[j] * value.stride(2), o, D);
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speclm, m) {
  m.def("small_m_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(speclm, CPU, m) {
  m.impl("small_m_attention", &small_m_attention);
}
