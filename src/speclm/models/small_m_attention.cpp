// speclm: attention of a few query rows over a key/value cache, float32, for CPUs with AVX2+FMA
// (the weighted values on AVX-512 where the build has it).
//
// A decoding step or a verify asks attention for 1 to a few dozen query rows over a cache of
// hundreds of slots. PyTorch's SDPA, traced into a compiled step over a static cache, reads the
// cache's whole capacity under a mask, and with grouped-query heads copies every shared key/value
// head for each query head that reads it. Here each (row, query head) reads its key/value head in
// place and only the slots its mask lets it see, so the cost follows the filled length.
//
// Every (batch row, head, query row) is computed in one fixed order of its own (scores over the
// visible slots in ascending order, the maximum, the exponentials (a vectorized polynomial) summed
// in 8 lanes in slot order, the values accumulated in registers in a fixed order of the slots), so
// a query row's output has the same bits whether it is alone in a step or among others in a verify.
// The query heads that share a key/value head (grouped-query attention) run together, up to
// kSharedHeads at a time, each slot's key and value loaded once for all of them: the cache is read
// from L2 once per group instead of once per head, and each head's arithmetic is what it would be
// alone (a head's output has the same bits whichever heads run beside it).
#include <torch/library.h>
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

constexpr int kSharedHeads = 3;  // query heads per pass over their key/value head (3 x 8 sums in registers)

// The 8 sums of a[0..7]'s lanes, reduced together (horizontal adds): a fixed tree for each.
inline __m256 fold8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q[h] . k[slot[j]] for NH query heads and 8 slots at once (head size a multiple of 8), into
// out[h]: one accumulator per (head, slot), then each head's 8 sums folded together. A slice of
// q[h] is loaded once for the 8 slots. With AVX-512 (head size a multiple of 16) each accumulator
// has 16 lanes, folded to 8 before the same horizontal adds, and a slot's slice of k is loaded
// once for the NH heads.
template <int NH>
inline void dot8(const float* const* q, const float* k, int64_t stride, const int64_t* slot, int64_t D, __m256* out) {
  const float* kj[8];
  for (int j = 0; j < 8; ++j) kj[j] = k + slot[j] * stride;
  __m256 a[NH][8];
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 w[NH][8], qd[NH];
    for (int h = 0; h < NH; ++h) qd[h] = _mm512_loadu_ps(q[h]);
    for (int j = 0; j < 8; ++j) {
      const __m512 kd = _mm512_loadu_ps(kj[j]);
      for (int h = 0; h < NH; ++h) w[h][j] = _mm512_mul_ps(qd[h], kd);
    }
    for (int64_t d = 16; d < D; d += 16) {
      for (int h = 0; h < NH; ++h) qd[h] = _mm512_loadu_ps(q[h] + d);
      for (int j = 0; j < 8; ++j) {
        const __m512 kd = _mm512_loadu_ps(kj[j] + d);
        for (int h = 0; h < NH; ++h) w[h][j] = _mm512_fmadd_ps(qd[h], kd, w[h][j]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int j = 0; j < 8; ++j)
        a[h][j] = _mm256_add_ps(_mm512_castps512_ps256(w[h][j]),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[h][j]), 1)));
  } else
#endif
  {
    for (int h = 0; h < NH; ++h) {  // 16 registers on AVX2: one head at a time
      const __m256 q0 = _mm256_loadu_ps(q[h]);
      for (int j = 0; j < 8; ++j) a[h][j] = _mm256_mul_ps(q0, _mm256_loadu_ps(kj[j]));
      for (int64_t d = 8; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q[h] + d);
        for (int j = 0; j < 8; ++j) a[h][j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kj[j] + d), a[h][j]);
      }
    }
  }
  for (int h = 0; h < NH; ++h) out[h] = fold8(a[h]);
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

// out[D] = sum over j of e[j] * v[seen[j]] / total, 32 outputs at a time, one chain of fused
// multiply-adds in slot order (AVX2, or a head size AVX-512's loop does not take).
inline void weighted_values_one(const float* e, const int64_t* seen, int64_t n, float total, const float* v,
                                int64_t stride, float* out, int64_t D) {
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

// out[h][D] = sum over j of e[h][j] * v[seen[j]] / total[h] for NH heads reading one value head,
// each output the same chain of fused multiply-adds whatever else runs. With AVX-512 (D a multiple
// of 16): 16 outputs of every head at a time, the slots split into two interleaved chains (even
// and odd j, added at the end) so that one slot's adds do not wait on the previous slot's, each
// slot's 16 values loaded once for the NH heads; otherwise weighted_values_one for each head.
template <int NH>
inline void weighted_values(const float* const* e, const int64_t* seen, int64_t n, const float* total,
                            const float* v, int64_t stride, float* const* out, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t i = 0; i < D; i += 16) {
      __m512 even[NH], odd[NH];
      for (int h = 0; h < NH; ++h) even[h] = odd[h] = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 2 <= n; j += 2) {
        const __m512 v0 = _mm512_loadu_ps(v + seen[j] * stride + i);
        const __m512 v1 = _mm512_loadu_ps(v + seen[j + 1] * stride + i);
        for (int h = 0; h < NH; ++h) {
          even[h] = _mm512_fmadd_ps(_mm512_set1_ps(e[h][j]), v0, even[h]);
          odd[h] = _mm512_fmadd_ps(_mm512_set1_ps(e[h][j + 1]), v1, odd[h]);
        }
      }
      if (j < n) {
        const __m512 v0 = _mm512_loadu_ps(v + seen[j] * stride + i);
        for (int h = 0; h < NH; ++h) even[h] = _mm512_fmadd_ps(_mm512_set1_ps(e[h][j]), v0, even[h]);
      }
      for (int h = 0; h < NH; ++h)
        _mm512_storeu_ps(out[h] + i, _mm512_mul_ps(_mm512_add_ps(even[h], odd[h]), _mm512_set1_ps(1.0f / total[h])));
    }
    return;
  }
#endif
  for (int h = 0; h < NH; ++h) weighted_values_one(e[h], seen, n, total[h], v, stride, out[h], D);
}

// Attention of NH query heads (q[h], out[h]) that read one key/value head (k, v) over the n slots
// seen[0, n) with their mask's biases; score and weight hold NH rows of L floats.
template <int NH>
void heads(const float* const* q, const float* k, int64_t kstride, const float* v, int64_t vstride,
           const int64_t* seen, const float* bias, int64_t n, int64_t L, float sc, float* score, float* weight,
           float* const* out, int64_t D) {
  if (n == 0) {  // nothing visible: zeros
    for (int h = 0; h < NH; ++h) std::fill(out[h], out[h] + D, 0.0f);
    return;
  }
  float* s[NH];
  float top[NH], total[NH];
  for (int h = 0; h < NH; ++h) {
    s[h] = score + h * L;
    std::copy_n(bias, n, s[h]);
    top[h] = -std::numeric_limits<float>::infinity();
  }
  int64_t j = 0;
  if (D % 8 == 0) {  // 8 slots at a time: score = dot * scale + bias (rounded as written)
    const __m256 scv = _mm256_set1_ps(sc);
    __m256 topv[NH], dots[NH];
    for (int h = 0; h < NH; ++h) topv[h] = _mm256_set1_ps(top[h]);
    for (; j + 8 <= n; j += 8) {
      dot8<NH>(q, k, kstride, seen + j, D, dots);
      for (int h = 0; h < NH; ++h) {
        const __m256 x = _mm256_add_ps(_mm256_mul_ps(dots[h], scv), _mm256_loadu_ps(s[h] + j));
        _mm256_storeu_ps(s[h] + j, x);
        topv[h] = _mm256_max_ps(topv[h], x);
      }
    }
    for (int h = 0; h < NH; ++h) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, topv[h]);
      for (const float l : lanes) top[h] = std::max(top[h], l);
    }
  }
  const float* e[NH];
  for (int h = 0; h < NH; ++h) {
    for (int64_t i = j; i < n; ++i) {
      s[h][i] = dot(q[h], k + seen[i] * kstride, D) * sc + s[h][i];
      top[h] = std::max(top[h], s[h][i]);
    }
    total[h] = exponentials(s[h], n, top[h], weight + h * L);
    e[h] = weight + h * L;
  }
  weighted_values<NH>(e, seen, n, total, v, vstride, out, D);
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

  // one parallel loop over (batch row, query row, key/value head, share of its query heads), shares
  // innermost: a thread finds a query row's visible slots and their mask's bias once for the
  // shares it takes of that row. A key/value head's `group` query heads are split into `shares`
  // runs of at most kSharedHeads (as even as they go: 4 -> 2 + 2).
  const int64_t shares = (group + kSharedHeads - 1) / kSharedHeads, per = (group + shares - 1) / shares;
  at::parallel_for(0, B * T * Hkv * shares, 1, [&](int64_t i0, int64_t i1) {
    // no zeroing where each is written before it is read
    std::unique_ptr<int64_t[]> seen(new int64_t[L]);
    std::unique_ptr<float[]> bias(new float[L]), score(new float[kSharedHeads * L]), weight(new float[kSharedHeads * L]);
    int64_t row = -1, n = 0;  // the (batch row, query row) whose slots are in seen[0, n)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t per_row = Hkv * shares;
      const int64_t b = i / (T * per_row), t = (i / per_row) % T, g = (i / shares) % Hkv, share = i % shares;
      if (i / per_row != row) {
        row = i / per_row;
        n = visible(mp == nullptr ? nullptr : mp + b * ms0 + t * ms2, mb == nullptr ? nullptr : mb + b * ms0 + t * ms2,
                    ms3, masked ? L : L - T + t + 1, seen.get(), bias.get());
      }
      const int64_t h0 = g * group + share * per, nh = std::min(per, group - share * per);  // 1 .. kSharedHeads
      const float* q[kSharedHeads];
      float* o[kSharedHeads];
      for (int64_t h = 0; h < nh; ++h) {
        q[h] = qp + b * query.stride(0) + (h0 + h) * query.stride(1) + t * query.stride(2);
        o[h] = op + ((b * T + t) * H + h0 + h) * D;
      }
      const float* k = kp + b * key.stride(0) + g * key.stride(1);
      const float* v = vp + b * value.stride(0) + g * value.stride(1);
      auto run = [&](auto count) {
        heads<decltype(count)::value>(q, k, key.stride(2), v, value.stride(2), seen.get(), bias.get(), n, L, sc,
                                      score.get(), weight.get(), o, D);
      };
      switch (nh) {
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
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
