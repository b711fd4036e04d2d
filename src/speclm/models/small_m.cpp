// speclm: float32 products of a few activation rows with a weight matrix, for CPUs with AVX2+FMA.
//
// y[M, N] = x[M, K] @ w[N, K]^T, the nn.Linear layout. A decoding step multiplies every weight
// by one row and a verify by a few; the BLAS runs 2-16 rows at 1.7-2.2x the cost of one row on
// an AVX2 CPU, because it packs the weights for a large product. Here a tile of 3 weight rows and
// 4 activation rows is multiplied in registers (12 accumulators, 7 loads for 12 FMAs), each
// weight row read from memory once for all activation rows, and the next 3 weight rows are asked
// into L2 while the first activation rows run, so the memory stream overlaps the arithmetic: a
// verify of a few tokens costs about what one token costs, and more rows cost only their
// arithmetic.
//
// Every output y[m, n] is summed in one fixed order that does not depend on M or on the tile it
// runs in: one 8-lane accumulator over K in steps of 8, reduced in a fixed tree, then any tail of
// K (K % 8) added in order. A row therefore gets bit-identical results alone or among others.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "small_m.h"

namespace {

using speclm::reduce;

constexpr int kRowTile = 4;  // activation rows sharing one load of a weight vector
constexpr int kColTile = 3;  // weight rows sharing one load of an activation vector

// y[r * ldy + c] = dot(x[r], w[c]) for R rows of x and C rows of w (both rows K floats apart).
// While it runs, the `ahead` weight rows after these (`next`) are asked into L2.
template <int R, int C>
inline void dot_tile(const float* x, const float* w, int64_t K, float* y, int64_t ldy,
                     const float* next, int64_t ahead) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t k_vec = K - K % 8;
  for (int64_t k = 0; k < k_vec; k += 8) {
    if (ahead > 0 && k % 16 == 0)  // one 64-byte line of each next row every 16 floats
      for (int64_t c = 0; c < ahead; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * K + k), _MM_HINT_T1);
    __m256 wv[C];
#pragma GCC unroll 3
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // unrolled, so the accumulators stay in registers
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < C; ++c) {
      float s = reduce(acc[r][c]);
      for (int64_t k = k_vec; k < K; ++k) s += x[r * K + k] * w[c * K + k];
      y[r * ldy + c] = s;
    }
}

// dot_tile for a tile of `rows` (1..kRowTile) x `cols` (1..kColTile), the shape picked at run time.
template <int R>
inline void dot_tile_cols(int64_t cols, const float* x, const float* w, int64_t K, float* y, int64_t ldy,
                          const float* next, int64_t ahead) {
  switch (cols) {
    case 3: dot_tile<R, 3>(x, w, K, y, ldy, next, ahead); break;
    case 2: dot_tile<R, 2>(x, w, K, y, ldy, next, ahead); break;
    default: dot_tile<R, 1>(x, w, K, y, ldy, next, ahead); break;
  }
}

at::Tensor small_m_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_m_mm runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_m_mm is float32");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_m_mm: x [M, K], w [N, K]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += kColTile) {
      const int64_t cols = std::min<int64_t>(kColTile, n1 - n);
      const int64_t ahead = std::min<int64_t>(kColTile, n1 - n - cols);  // this thread's next weight rows
      for (int64_t m = 0; m < M; m += kRowTile) {
        const float* xr = xp + m * K;
        const float* wr = wp + n * K;
        float* out = yp + m * N + n;
        const int64_t pre = m == 0 ? ahead : 0;  // asked for once, by the first activation rows
        switch (std::min<int64_t>(kRowTile, M - m)) {
          case 4: dot_tile_cols<4>(cols, xr, wr, K, out, N, wr + cols * K, pre); break;
          case 3: dot_tile_cols<3>(cols, xr, wr, K, out, N, wr + cols * K, pre); break;
          case 2: dot_tile_cols<2>(cols, xr, wr, K, out, N, wr + cols * K, pre); break;
          default: dot_tile_cols<1>(cols, xr, wr, K, out, N, wr + cols * K, pre); break;
        }
      }
    }
  });
  return y;
}

// ---- GGUF blocks: the file's own 4-bit and 8-bit codes, 32 inputs a block -------------------
//
// Q4_0 / Q4_1: 16 bytes a block, byte j holding input j (low nibble) and input j + 16 (high);
// the weight is scale * (q - 8) (Q4_0: no minimum) or scale * q + minimum (Q4_1). Q8_0: 32 signed
// bytes a block, the weight scale * q. Each weight comes out as llama.cpp rounds it (one product,
// then the minimum added), so reading the layer back with one-hot rows gives the file's values. So y[m, n] = sum over blocks b of scale[n, b] * (q_b . x_b) +
// minimum[n, b] * sum(x_b): the codes are decoded to floats once per weight row and used for
// every activation row, and the block sums of x are computed once per call.

template <bool kCentered>  // Q4_0: codes - 8
struct Q4Block {
  static constexpr int64_t kBytes = 16;
  static inline void decode(const uint8_t* p, __m256 q[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    if (kCentered) {
      const __m256 eight = _mm256_set1_ps(8.0f);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_ps(q[i], eight);
    }
  }
};

struct Q8Block {
  static constexpr int64_t kBytes = 32;
  static inline void decode(const uint8_t* p, __m256 q[4]) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
};


// out[r * ldo] for R rows of x (row stride K) and one weight row of nb blocks; xsum [R, nb].
template <class Block, int R>
inline void block_rows(const float* x, const float* xsum, const uint8_t* codes, const float* scale,
                       const float* minimum, int64_t nb, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R];
  float msum[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); msum[r] = 0.0f; }
  for (int64_t b = 0; b < nb; ++b) {
    __m256 q[4];
    Block::decode(codes + b * Block::kBytes, q);
    const __m256 d = _mm256_set1_ps(scale[b]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * 32;
      __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
      t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
      t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
      acc[r] = _mm256_fmadd_ps(d, t, acc[r]);
      if (minimum != nullptr) msum[r] = std::fma(minimum[b], xsum[r * nb + b], msum[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r * ldo] = reduce(acc[r]) + msum[r];
}

template <class Block>
void blocks_mm(const float* xp, const float* xsum, const uint8_t* cp, const float* sp, const float* mp,
               int64_t M, int64_t K, int64_t N, float* yp) {
  const int64_t nb = K / 32, row_bytes = nb * Block::kBytes;
  speclm::for_row_groups(M, N, [&](auto R, int64_t m, int64_t n) {
    block_rows<Block, decltype(R)::value>(xp + m * K, xsum + m * nb, cp + n * row_bytes, sp + n * nb,
                                          mp == nullptr ? nullptr : mp + n * nb, nb, K, yp + m * N + n, N);
  });
}

// The float32 weights [N, K] of a block layer, each rounded as llama.cpp and gguf-py round it
// (scale * code, then + minimum): what a prefill of many rows multiplies with the BLAS.
template <class Block>
void dequantize_rows(const uint8_t* cp, const float* sp, const float* mp, int64_t N, int64_t K, float* wp) {
  const int64_t nb = K / 32, row_bytes = nb * Block::kBytes;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        __m256 q[4];
        Block::decode(cp + n * row_bytes + b * Block::kBytes, q);
        const __m256 d = _mm256_set1_ps(sp[n * nb + b]);
        const __m256 mn = _mm256_set1_ps(mp == nullptr ? 0.0f : mp[n * nb + b]);
        float* out = wp + n * K + b * 32;
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          __m256 w = _mm256_mul_ps(d, q[i]);
          if (mp != nullptr) w = _mm256_add_ps(w, mn);  // compiled with -ffp-contract=off: no FMA
          _mm256_storeu_ps(out + 8 * i, w);
        }
      }
    }
  });
}

at::Tensor dequantize_blocks(const at::Tensor& codes, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& minimum, int64_t bits) {
  const int64_t K = scale.size(1) * 32, N = codes.size(0);
  speclm::check_blocks(codes, scale, minimum, bits, K);
  const at::Tensor cc = codes.contiguous(), sc = scale.contiguous();
  const at::Tensor mc = minimum.has_value() ? minimum->contiguous() : at::Tensor();
  at::Tensor w = at::empty({N, K}, sc.options());
  const float* mp = mc.defined() ? mc.data_ptr<float>() : nullptr;
  if (bits == 4 && mp == nullptr)
    dequantize_rows<Q4Block<true>>(cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mp, N, K, w.data_ptr<float>());
  else if (bits == 4)
    dequantize_rows<Q4Block<false>>(cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mp, N, K, w.data_ptr<float>());
  else
    dequantize_rows<Q8Block>(cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mp, N, K, w.data_ptr<float>());
  return w;
}

}  // namespace

at::Tensor speclm::small_m_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                  const c10::optional<at::Tensor>& minimum, int64_t bits) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "small_m_blocks: x is float32 [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / 32;
  speclm::check_blocks(codes, scale, minimum, bits, K);
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous();
  const at::Tensor mc = minimum.has_value() ? minimum->contiguous() : at::Tensor();
  // block sums of x (for the minimums), each summed in input order
  at::Tensor xsum = at::empty({M, nb}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* xs = xsum.data_ptr<float>();
  for (int64_t i = 0; mc.defined() && i < M * nb; ++i) {
    float s = 0.0f;
    for (int j = 0; j < 32; ++j) s += xp[i * 32 + j];
    xs[i] = s;
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* mp = mc.defined() ? mc.data_ptr<float>() : nullptr;
  if (bits == 4 && mp == nullptr)  // Q4_0
    blocks_mm<Q4Block<true>>(xp, xs, cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mp, M, K, N, y.data_ptr<float>());
  else if (bits == 4)  // Q4_1
    blocks_mm<Q4Block<false>>(xp, xs, cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mp, M, K, N, y.data_ptr<float>());
  else
    blocks_mm<Q8Block>(xp, xs, cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), mp, M, K, N, y.data_ptr<float>());
  return y;
}


TORCH_LIBRARY(speclm, m) {
  m.def("small_m_mm(Tensor x, Tensor w) -> Tensor");
  m.def("small_m_blocks(Tensor x, Tensor codes, Tensor scale, Tensor? minimum, int bits) -> Tensor");
  m.def("dequantize_blocks(Tensor codes, Tensor scale, Tensor? minimum, int bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(speclm, CPU, m) {
  m.impl("small_m_mm", &small_m_mm);
  m.impl("small_m_blocks", &speclm::small_m_blocks);
  m.impl("dequantize_blocks", &dequantize_blocks);
}
