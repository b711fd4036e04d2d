// speclm's CPU kernels (small_m*.cpp): what they share.
#pragma once
// torch's lean headers, not torch/extension.h (pybind11 and the whole C++ API): each unit
// builds in 7-16 s instead of ~45-50 s (timed on a Zen 3 VM)
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <atomic>
#include <type_traits>
#include <vector>

namespace speclm {

// The sum of a + b's 16 lanes, reduced in one fixed tree (the same bits whatever else runs).
inline float reduce(__m256 a, __m256 b = _mm256_setzero_ps()) {
  const __m256 s = _mm256_add_ps(a, b);
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
  return _mm_cvtss_f32(v);
}

// The loop of every kernel on a GGUF layer's blocks: weight rows n0 .. n1 - 1, each read once for
// groups of up to 4 activation rows; rows(R, m, n) computes y[m .. m + R - 1, n], R a compile-time
// std::integral_constant so that the row loops unroll.
template <class Rows>
inline void row_groups(int64_t M, int64_t n0, int64_t n1, const Rows& rows) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; m += 4) {
      switch (std::min<int64_t>(4, M - m)) {
        case 4: rows(std::integral_constant<int, 4>{}, m, n); break;
        case 3: rows(std::integral_constant<int, 3>{}, m, n); break;
        case 2: rows(std::integral_constant<int, 2>{}, m, n); break;
        default: rows(std::integral_constant<int, 1>{}, m, n); break;
      }
    }
  }
}

// Asks into L1 what a tile-layout product reads kPrefetchBytes after the block it is on: the block's
// codes (bytes of them) and its scales and minimums (minimum null for Q4_0 and Q8_0), the same
// distance ahead, a quarter as far in those four-times-smaller arrays. Past a group's last block it
// reaches the next group's (groups lie one after another). Without it the products of a few rows
// wait on memory (benchmarks/small_m_gemm.py on a Zen 4 VM: 1 row 2.0 -> 1.6 ms, 8 rows 3.4 -> 2.8
// ms; 1,024 and 4,096 bytes measured alike).
constexpr int64_t kPrefetchBytes = 2048;
inline void prefetch_ahead(const uint8_t* codes, int64_t bytes, const float* scale, const float* minimum) {
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(codes + kPrefetchBytes + c), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scale + kPrefetchBytes / 4), _MM_HINT_T0);
  if (minimum != nullptr) _mm_prefetch(reinterpret_cast<const char*>(minimum + kPrefetchBytes / 4), _MM_HINT_T0);
}

// factor x the sum of each block of 32 8-bit activation codes (qx [blocks, 32]): what a tile product
// that feeds signed weights in shifted up by `factor` (as unsigned bytes) takes back, exactly.
inline std::vector<int32_t> shifted_block_sums(const int8_t* qx, int64_t blocks, int32_t factor) {
  std::vector<int32_t> sums(blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    int32_t total = 0;
    for (int j = 0; j < 32; ++j) total += qx[i * 32 + j];
    sums[i] = factor * total;
  }
  return sums;
}

// row_groups over all N weight rows, split between at::parallel_for's threads.
template <class Rows>
inline void for_row_groups(int64_t M, int64_t N, const Rows& rows) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { row_groups(M, n0, n1, rows); });
}

// The argument checks of every op on a GGUF layer's blocks (codes, scales, minimums).
inline void check_blocks(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& minimum,
                  int64_t bits, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "small_m_blocks: bits is 4 (Q4_0 without a minimum, Q4_1 with one) or 8 (Q8_0)");
  TORCH_CHECK(K % 32 == 0, "small_m_blocks: K must be a multiple of 32");
  const int64_t N = codes.size(0), nb = K / 32;
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 2 &&
              codes.size(1) == nb * (bits == 4 ? 16 : 32),
              "small_m_blocks: codes are uint8 [N, K/32 * bytes per block] on the CPU");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == nb,
              "small_m_blocks: scale is float32 [N, K/32]");
  TORCH_CHECK(!minimum.has_value() || (bits == 4 && minimum->scalar_type() == at::kFloat &&
                                       minimum->sizes() == scale.sizes()),
              "small_m_blocks: minimum is float32 [N, K/32], for 4-bit blocks only");
}

// y [M, N] = x [M, K] times a GGUF layer's blocks: float activations (small_m.cpp) or 8-bit
// activations and integer dot products (small_m_q8.cpp).
at::Tensor small_m_blocks(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& minimum, int64_t bits);
at::Tensor small_m_blocks_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& minimum, int64_t bits);

// A layer's blocks repacked in AMX's tile layout (small_m_tiles.cpp): codes [groups, blocks, 256 or 512
// bytes], scale and minimum [groups, blocks, 16], for kTileCols = 16 weight rows per group.
constexpr int64_t kTileCols = 16;
struct TileLayer {
  at::Tensor codes, scale;
  c10::optional<at::Tensor> minimum;
  int64_t bits, N, groups;
};
// Whether the block layers registered from now on are repacked for tile_product. enable_tiles()
// turns that on (every build) and, with use_amx on an AMX build, asks the OS for AMX's tile state:
// returns whether products of several rows run on AMX tiles (else on AVX-512 VNNI or AVX2, with
// the same bits).
std::atomic<bool>& tiles_on();
bool enable_tiles(bool use_amx);
TileLayer tile_layer(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& minimum,
                     int64_t bits);
// y [M, N] (rows ldy floats apart) weight-row groups g0 .. g1 - 1 (columns 16 g0 .. 16 g1 - 1) =
// 8-bit activations (codes qx [M, K], scales dx, scaled sums sx [M, K / 32], as small_m_q8.cpp
// quantizes them) times the layer: on AMX or AVX-512 VNNI (small_m_tiles.cpp), or on AVX2
// (avx2_tile_product, small_m_tiles_avx2.cpp) where the build has no AVX-512.
void tile_product(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K, const TileLayer& w,
                  int64_t g0, int64_t g1, float* y, int64_t ldy);
void avx2_tile_product(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                       const TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy);

}  // namespace speclm
