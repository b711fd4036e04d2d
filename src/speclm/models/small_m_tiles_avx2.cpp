// speclm: a GGUF file's Q4_0/Q4_1/Q8_0 blocks, repacked in the tile layout, times 8-bit
// activations on a CPU with AVX2 only (no AVX-512): what registered block layers run there.
//
// small_m_q8.cpp's loop over the file's own layout needs one horizontal dot product per weight
// row: per block of 32 inputs and activation row, a load, vpmaddubsw, vpmaddwd, a conversion and
// a scaled add for each weight row, about 10 instructions, so a verify of 8 rows cost 4.5 one-row
// products. The tile layout (small_m_tiles.cpp: per 16 weight rows and block, 8 rows of 64 bytes,
// row i holding inputs 4i .. 4i + 3 of each weight row) puts 8 weight rows side by side in one
// 256-bit half: one vpmaddubsw against 4 activation bytes broadcast multiplies them for all 8
// weight rows at once, so a block and activation row costs ~4 instructions per weight row, and the
// 8 sums come out in 8 lanes with no horizontal reduction.
//
// The integer dot of every (activation row, weight row, block) is exact, as on VNNI and AMX:
// - 4-bit codes (0..15) times activations (|q| <= 127): a vpmaddubsw pair is at most 3,810 and the
//   8 pairs of a block summed in 16 bits at most 30,480, below 32,767: no saturation; Q4_0's
//   codes go in unshifted and 8 times the block's activation sum is taken back;
// - 8-bit codes: |w| times x * sign(w) (pairs at most 32,258), widened to 32 bits per tile row.
// The float part is small_m_tiles.cpp's scale_block on 8 lanes, the same operations in the same
// order per (row, weight row), so a row has the same bits alone or among others, and the same as
// on an AVX-512 VNNI or AMX build.
#include "small_m.h"

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kCols = speclm::kTileCols;  // weight rows per group (two 8-lane halves here)

inline __m256i broadcast4(const int8_t* x) {  // 4 activation bytes, to all 8 lanes
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

// One block's exact integer dots [8] of one activation row (32 codes at x) with half a group's
// 8 weight rows: wr[i] = tile row i's 32 bytes for those rows (4-bit: unpacked codes; 8-bit:
// the signed codes), wa[i] their absolute values (8-bit only).
template <int Bits>
inline __m256i block_dots(const int8_t* x, const __m256i* wr, const __m256i* wa) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (Bits == 4) {
    __m256i pairs = _mm256_maddubs_epi16(wr[0], broadcast4(x));
#pragma GCC unroll 7
    for (int i = 1; i < 8; ++i) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wr[i], broadcast4(x + 4 * i)));
    return _mm256_madd_epi16(pairs, ones);
  }
  __m256i dots = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m256i signed_x = _mm256_sign_epi8(broadcast4(x + 4 * i), wr[i]);  // |w| * (x * sign(w)) = w * x
    dots = _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[i], signed_x), ones));
  }
  return dots;
}

template <int Bits, bool Signed>
void avx2_groups(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                 const speclm::TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = K / 32, bytes = Bits == 4 ? 256 : 512;
  const bool shifted = Bits == 4 && Signed;  // Q4_0: codes q stored, weights q - 8
  const std::vector<int32_t> shift = speclm::shifted_block_sums(qx, shifted ? M * nb : 0, 8);
  const uint8_t* codes = w.codes.data_ptr<uint8_t>();
  const float* scale = w.scale.data_ptr<float>();
  const float* minimum = w.minimum.has_value() ? w.minimum->data_ptr<float>() : nullptr;
  const __m256i low = _mm256_set1_epi8(0x0F);
  std::vector<__m256> acc(M), offset(M);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t half = 0; half < 2; ++half) {  // weight rows 16 g + 8 half .. + 7
      const int64_t first = g * kCols + 8 * half, cols = std::min<int64_t>(8, w.N - first);
      if (cols <= 0) break;
      std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
      std::fill(offset.begin(), offset.end(), _mm256_setzero_ps());
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = codes + (g * nb + b) * bytes + 32 * half;
        const int64_t at = (g * nb + b) * kCols + 8 * half;
        if (half == 0)  // the blocks ahead, into L1 (the second half reads this group from there)
          speclm::prefetch_ahead(codes + (g * nb + b) * bytes, bytes, scale + at, minimum != nullptr ? minimum + at : nullptr);
        __m256i wr[8], wa[8];
        for (int i = 0; i < 8; ++i) {
          if (Bits == 8) {
            wr[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i));
            wa[i] = _mm256_abs_epi8(wr[i]);
          } else if (i % 2 == 0) {  // 64-byte chunk i / 2: tile row i in the low nibbles, i + 1 in the high
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
            wr[i] = _mm256_and_si256(v, low);
            wr[i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          }
        }
        const __m256 ws = _mm256_loadu_ps(scale + at);
        const __m256 wm = minimum != nullptr ? _mm256_loadu_ps(minimum + at) : _mm256_setzero_ps();
        for (int64_t r = 0; r < M; ++r) {
          __m256i dots = block_dots<Bits>(qx + r * K + b * 32, wr, wa);
          if (shifted) dots = _mm256_sub_epi32(dots, _mm256_set1_epi32(shift[r * nb + b]));
          // small_m_tiles.cpp's scale_block, on 8 lanes
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(ws, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
          if (minimum != nullptr) offset[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(sx[r * nb + b]), offset[r]);
        }
      }
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(cols)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int64_t r = 0; r < M; ++r) _mm256_maskstore_ps(y + r * ldy + first, keep, _mm256_add_ps(acc[r], offset[r]));
    }
  }
}

}  // namespace

void speclm::avx2_tile_product(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                               const TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  if (w.bits == 8) avx2_groups<8, true>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
  else if (!w.minimum.has_value()) avx2_groups<4, true>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
  else avx2_groups<4, false>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
}

#endif
