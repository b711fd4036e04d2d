// speclm: attention of a few query rows over a key/value cache, float32, for CPUs with AVX2+FMA
// (the weighted values on AVX-512 where the build has it).
//
// A decoding step or a verify asks attention for 1 to a few dozen query rows over a cache of
// hundreds of slots. PyTorch's SDPA, traced into a compiled step over a static cache, reads the
// cache's whole capacity under a mask, and with grouped-query heads copies every shared key/value
// head for each query head that reads it. Here each (row, query head) reads its key/value head in
// place and only the slots its mask lets it see, so the cost follows the filled length.
//
// Every (batch row, head, query row) is computed on its own in one fixed order (scores over the
// visible slots in ascending order, the maximum, the exponentials (a vectorized polynomial) summed
// in 8 lanes in slot order, the values accumulated in registers in a fixed order of the slots), so
// a query row's output has the same bits whether it is alone in a step or among others in a verify.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <memory>

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

// q . k[slot[j]] for 8 slots at once (head size a multiple of 8): one accumulator per slot, then
// the 8 sums reduced together (horizontal adds): a fixed order for each slot, whatever its batch.
// A slice of q is loaded once for the 8 slots. With AVX-512 (head size a multiple of 16) each
// slot's accumulator has 16 lanes, folded to 8 before the same horizontal adds.
inline __m256 dot8(const float* q, const float* k, int64_t stride, const int64_t* slot, int64_t D) {
  const float* kj[8];
  for (int j = 0; j < 8; ++j) kj[j] = k + slot[j] * stride;
  __m256 a[8];
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 w[8];
    const __m512 q0 = _mm512_loadu_ps(q);
    for (int j = 0; j < 8; ++j) w[j] = _mm512_mul_ps(q0, _mm512_loadu_ps(kj[j]));
    for (int64_t d = 16; d < D; d += 16) {
      const __m512 qd = _mm512_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) w[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kj[j] + d), w[j]);
    }
    for (int j = 0; j < 8; ++j)
      a[j] = _mm256_add_ps(_mm512_castps512_ps256(w[j]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[j]), 1)));
  } else
#endif
  {
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(kj[j]));
    for (int64_t d = 8; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kj[j] + d), a[j]);
    }
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The slots [0, end) a query row sees, in ascending order, into slot[0, n), and its mask's bias for
// each into bias (0 without a mask); returns n. An additive mask hides a slot with the lowest
// float or -inf, a boolean one with false. Contiguous masks are read 8 slots at a time.
int64_t visible(const float* mrow, const bool* brow, int64_t stride, int64_t end, int64_t* slot, float* bias) {
  const float lowest = std::numeric_limits<float>::lowest();
  int64_t n = 0, s = 0;
  if (mrow == nullptr && brow == nullptr) {
    for (; s < end; ++s) slot[s] = s, bias[s] = 0.0f;
    return end;
  }
  if (stride == 1) {
    const __m256 low = _mm256_set1_ps(lowest);
    for (; s + 8 <= end; s += 8) {
      unsigned seen;
      if (mrow != nullptr) {
        seen = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(mrow + s), low, _CMP_GT_OQ));
      } else {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(brow + s));
        seen = ~_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_setzero_si128())) & 0xFF;
      }
      for (; seen != 0; seen &= seen - 1) {
        const int64_t at = s + __builtin_ctz(seen);
        slot[n] = at;
        bias[n++] = mrow != nullptr ? mrow[at] : 0.0f;
      }
    }
  }
  for (; s < end; ++s) {
    const float b = mrow != nullptr ? mrow[s * stride] : 0.0f;
    if (mrow != nullptr ? b > lowest : brow[s * stride]) slot[n] = s, bias[n++] = b;
  }
  return n;
}

// exp(x) for x <= 0, 8 at a time: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two
// parts) and p a degree-6 Taylor polynomial (relative error ~2e-7, 1-2 ulp from std::exp); 0 below
// -87.3, where exp underflows float32's normal range; NaN for NaN (a NaN score makes its row NaN).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  const __m256 kept = _mm256_or_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ),
                                   _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // a NaN stays NaN, as std::exp's
  return _mm256_and_ps(e, kept);
}

// e[0, n) = exp(score[0, n) - top); returns their sum (8 lanes in slot order, then a fixed tree).
inline float exponentials(const float* score, int64_t n, float top, float* e) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t left = std::min<int64_t>(8, n - j);
    const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 x = _mm256_sub_ps(_mm256_maskload_ps(score + j, in), t);
    const __m256 v = _mm256_and_ps(exp_nonpositive(x), _mm256_castsi256_ps(in));
    _mm256_maskstore_ps(e + j, in, v);
    total = _mm256_add_ps(total, v);
  }
  return speclm::reduce(total);
}

// out[D] = sum over j of e[j] * v[seen[j]] / total, each output the same chain of fused
// multiply-adds whatever else runs. With AVX-512 (D a multiple of 16, at most 128): all of D in
// one pass, the slots split into two interleaved chains (even and odd j, added at the end), so
// one slot's adds do not wait on the previous slot's; otherwise 32 outputs at a time, one chain
// in slot order.
inline void weighted_values(const float* e, const int64_t* seen, int64_t n, float total, const float* v,
                            int64_t stride, float* out, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 128) {
    const int64_t c = D / 16;
    __m512 even[8], odd[8];
    for (int64_t i = 0; i < c; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const float* r0 = v + seen[j] * stride;
      const float* r1 = v + seen[j + 1] * stride;
      const __m512 p0 = _mm512_set1_ps(e[j]), p1 = _mm512_set1_ps(e[j + 1]);
      for (int64_t i = 0; i < c; ++i) {
        even[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(r0 + 16 * i), even[i]);
        odd[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(r1 + 16 * i), odd[i]);
      }
    }
    if (j < n) {
      const float* r0 = v + seen[j] * stride;
      const __m512 p0 = _mm512_set1_ps(e[j]);
      for (int64_t i = 0; i < c; ++i) even[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(r0 + 16 * i), even[i]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int64_t i = 0; i < c; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), inv));
    return;
  }
#endif
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t j = 0; j < n; ++j) {
      const float* row = v + seen[j] * stride + d;
      const __m256 p = _mm256_set1_ps(e[j]);
      for (int c = 0; c < 4; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + 8 * c), acc[c]);
    }
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + d + 8 * c, _mm256_mul_ps(acc[c], inv));
  }
  for (; d < D; ++d) {  // a head size not a multiple of 32
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(e[j], v[seen[j] * stride + d], acc);
    out[d] = acc * (1.0f / total);
  }
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
  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  at::Tensor out = at::empty({B, T, H, D}, query.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // one parallel loop over (batch row, query row, head), heads innermost: a thread finds a query
  // row's visible slots and their mask's bias once for the heads it takes of that row
  at::parallel_for(0, B * T * H, 1, [&](int64_t i0, int64_t i1) {
    // no zeroing where each is written before it is read
    std::unique_ptr<int64_t[]> seen(new int64_t[L]);
    std::unique_ptr<float[]> bias(new float[L]), score(new float[L]), weight(new float[L]);
    int64_t row = -1, n = 0;  // the (batch row, query row) whose slots are in seen[0, n)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (T * H), t = (i / H) % T, h = i % H, g = h / group;
      if (i / H != row) {
        row = i / H;
        n = visible(mp == nullptr ? nullptr : mp + b * ms0 + t * ms2, mb == nullptr ? nullptr : mb + b * ms0 + t * ms2,
                    ms3, masked ? L : L - T + t + 1, seen.get(), bias.get());
      }
      const float* q = qp + b * query.stride(0) + h * query.stride(1) + t * query.stride(2);
      const float* k = kp + b * key.stride(0) + g * key.stride(1);
      const float* v = vp + b * value.stride(0) + g * value.stride(1);
      float* o = op + ((b * T + t) * H + h) * D;
      if (n == 0) {  // nothing visible: zeros
        std::fill(o, o + D, 0.0f);
        continue;
      }
      std::copy_n(bias.get(), n, score.get());
      float top = -std::numeric_limits<float>::infinity();
      int64_t j = 0;
      if (D % 8 == 0) {  // 8 slots at a time: score = dot * scale + bias (rounded as written)
        const __m256 scv = _mm256_set1_ps(sc);
        __m256 topv = _mm256_set1_ps(top);
        for (; j + 8 <= n; j += 8) {
          const __m256 x = _mm256_add_ps(_mm256_mul_ps(dot8(q, k, key.stride(2), seen.get() + j, D), scv),
                                         _mm256_loadu_ps(score.get() + j));
          _mm256_storeu_ps(score.get() + j, x);
          topv = _mm256_max_ps(topv, x);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, topv);
        for (const float l : lanes) top = std::max(top, l);
      }
      for (; j < n; ++j) {
        score[j] = dot(q, k + seen[j] * key.stride(2), D) * sc + score[j];
        top = std::max(top, score[j]);
      }
      const float total = exponentials(score.get(), n, top, weight.get());
      weighted_values(weight.get(), seen.get(), n, total, v, value.stride(2), o, D);
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
