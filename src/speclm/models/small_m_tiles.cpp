// speclm: a GGUF file's Q4_0/Q4_1/Q8_0 blocks times 8-bit activations, on CPUs with AVX-512 VNNI
// (and AMX-INT8 tiles where the CPU has them, such as Sapphire Rapids): what registered block
// layers run where small_m.py builds for these CPUs.
//
// A layer is repacked once, when it is registered (small_m_q8.cpp), into AMX's tile layout: per
// 16 weight rows and block of 32 inputs, 8 rows of 64 bytes, row i holding inputs 4i .. 4i + 3 of
// each of the 16 weight rows (4-bit codes stay 4-bit, two tile rows a byte); scales and minimums
// as [groups, blocks, 16] floats. Two products read it and give the same exact int32 dot product
// of every (activation row, weight row, block):
// - vnni_groups (AVX-512 VNNI), for few rows: one vpdpbusd adds a tile row's 4 inputs to all 16
//   dots at once, so 8 instructions a block and activation row for 16 weight rows and no
//   horizontal sums (small_m_q8.cpp's AVX2 loop needs ~7 a block for each weight row);
// - tile_groups (AMX), from kAmxMinRows rows: one tile instruction for up to 16 activation rows,
//   two groups of 16 weight rows at a time (their blocks unpacked once for all activation rows),
//   one block's products running while the previous block's sums are scaled (two tile sets).
// Each (row, weight row) output is then scaled and summed over blocks in input order by the same
// float32 operations (scale_block):
//     y[r, n] = fma-chain over b of float(dot[r, n, b]) * (d_w[n, b] * d_x[r, b])
//             + fma-chain over b of min[n, b] * s_x[r, b]                          (Q4_1 only)
// which depend on nothing but (r, n): a row's result has the same bits alone or among 32, on either
// product (the verifier's rows equal the decode steps' rows).
#include "small_m.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kCols = speclm::kTileCols;  // weight rows per tile (its columns)
constexpr int64_t kTileRows = 16;  // activation rows per tile
std::atomic<bool> amx{false};  // granted: products of kAmxMinRows rows and more run on the tiles
constexpr int64_t kAmxMinRows = 16;  // below, vnni_groups is faster (benchmarks/small_m_gemm.py)

// The float part both products share, for one activation row and one block of 16 weight rows:
// acc += float(dots) * (d_w * d_x), offset += minimum * s_x (Q4_1). The same operations in the same
// order for every row, whichever product computed the (exact) integer dots.
inline void scale_block(__m512i dots, __m512 ws, const float* wm, float dx, float sx, __m512& acc, __m512& offset) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(ws, _mm512_set1_ps(dx)), acc);
  if (wm != nullptr) offset = _mm512_fmadd_ps(_mm512_loadu_ps(wm), _mm512_set1_ps(sx), offset);
}

inline void store_rows(const __m512* acc, const __m512* offset, int64_t rows, float* y, int64_t ldy, int64_t cols) {
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(acc[r], offset[r]));
}

// Tile rows 2c and 2c + 1 of a 4-bit block from its packed 64-byte chunk c (low and high nibbles).
inline void unpack4(const uint8_t* p, int c, __m512i& even, __m512i& odd) {
  const __m512i low = _mm512_set1_epi8(0x0F), v = _mm512_loadu_si512(p + 64 * c);
  even = _mm512_and_si512(v, low);
  odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}

// The same integer dots with AVX-512 VNNI, for few rows: the tile layout's 64-byte row i holds
// inputs 4i .. 4i + 3 of all 16 weight rows, so one vpdpbusd against those 4 activation bytes
// (broadcast) adds them to all 16 dots at once: 8 per block, no horizontal sums. vpdpbusd
// multiplies unsigned by signed bytes: signed weights go in shifted up (Q4_0: its codes q, not
// q - 8; Q8_0: w + 128) and the shift times the block's activation sum is taken back, exactly.
//
// One group of 16 weight rows times R activation rows, R known at compile time so that the R rows'
// sums stay in registers from the first block to the last (kept in memory, each block and row
// paid two loads and two stores beside its 8 vpdpbusd); the group's blocks are unpacked once for
// the R rows, and read again from the caches for the next R; the blocks ahead are prefetched.
constexpr int kRowChunk = 8;  // rows per pass over a group: 8 x 2 sums and 8 weight vectors fit the 32 registers

template <int Bits, bool Signed, int R>
inline void vnni_group_rows(const int8_t* qx, const float* dx, const float* sx, const int32_t* taken, int64_t K,
                            int64_t nb, const uint8_t* codes, const float* scale, const float* minimum, float* y,
                            int64_t ldy, int64_t cols) {
  constexpr int64_t bytes = Bits == 4 ? 256 : 512;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R], offset[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = codes + b * bytes;
    speclm::prefetch_ahead(p, bytes, scale + b * kCols, Signed ? nullptr : minimum + b * kCols);
    __m512i wr[8];  // the block's 8 tile rows, as unsigned bytes
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      if (Bits == 8) {
        wr[i] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * i), flip);
      } else if (i % 2 == 0) {
        unpack4(p, i / 2, wr[i], wr[i + 1]);
      }
    }
    const __m512 ws = _mm512_loadu_ps(scale + b * kCols);
    const float* wm = Signed ? nullptr : minimum + b * kCols;  // Q4_1, the one unsigned type, has minimums
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = qx + r * K + b * 32;
      __m512i dots = Signed ? _mm512_set1_epi32(-taken[r * nb + b]) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        int32_t four;  // inputs 4i .. 4i + 3, broadcast to the 16 weight rows
        std::memcpy(&four, xr + 4 * i, 4);
        dots = _mm512_dpbusd_epi32(dots, wr[i], _mm512_set1_epi32(four));
      }
      scale_block(dots, ws, wm, dx[r * nb + b], sx[r * nb + b], acc[r], offset[r]);
    }
  }
  store_rows(acc, offset, R, y, ldy, cols);
}

template <int Bits, bool Signed>
void vnni_groups(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                 const speclm::TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = K / 32, bytes = Bits == 4 ? 256 : 512;
  const int32_t shift = Bits == 4 ? 8 : 128;
  const std::vector<int32_t> taken = speclm::shifted_block_sums(qx, Signed ? M * nb : 0, shift);  // shift x block sums
  const uint8_t* codes = w.codes.data_ptr<uint8_t>();
  const float* scale = w.scale.data_ptr<float>();
  const float* minimum = w.minimum.has_value() ? w.minimum->data_ptr<float>() : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t cols = std::min(kCols, w.N - g * kCols);
    for (int64_t m = 0; m < M; m += kRowChunk) {
      auto rows = [&](auto chunk) {
        vnni_group_rows<Bits, Signed, decltype(chunk)::value>(
            qx + m * K, dx + m * nb, sx + m * nb, Signed ? taken.data() + m * nb : nullptr, K, nb,
            codes + g * nb * bytes, scale + g * nb * kCols, minimum != nullptr ? minimum + g * nb * kCols : nullptr,
            y + m * ldy + g * kCols, ldy, cols);
      };
      switch (std::min<int64_t>(kRowChunk, M - m)) {
        case 8: rows(std::integral_constant<int, 8>{}); break;
        case 7: rows(std::integral_constant<int, 7>{}); break;
        case 6: rows(std::integral_constant<int, 6>{}); break;
        case 5: rows(std::integral_constant<int, 5>{}); break;
        case 4: rows(std::integral_constant<int, 4>{}); break;
        case 3: rows(std::integral_constant<int, 3>{}); break;
        case 2: rows(std::integral_constant<int, 2>{}); break;
        default: rows(std::integral_constant<int, 1>{}); break;
      }
    }
  }
}

#if defined(__AMX_INT8__)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are volatile asm that tell the compiler nothing about the memory they read
// or write (the tile configuration, the weight buffer, the sums): this barrier keeps the C++ loads
// and stores of that memory on their side of the tile instructions.
inline void memory_fence() { __asm__ __volatile__("" ::: "memory"); }

// Two sets of tiles, used in turn from block to block so that one block's products run while the
// other's sums are scaled: set A = sums 0 and 3 (two groups of 16 weight rows), activations 1;
// set B = sums 5 and 6, activations 7; weights 2 and 4 (one tile per group). Sums [M, 16] int32,
// activations [M, 32 bytes], weights [8, 64 bytes].
void configure(int64_t M) {
  TileConfig cfg;
  for (int t : {0, 3, 5, 6}) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(M);
  for (int t : {1, 7}) cfg.colsb[t] = 32, cfg.rows[t] = static_cast<uint8_t>(M);
  for (int t : {2, 4}) cfg.colsb[t] = 64, cfg.rows[t] = 8;
  memory_fence();
  _tile_loadconfig(&cfg);
  memory_fence();
}

// the 8 x 64-byte weight tile of one block of 16 weight rows, into buf (4-bit: unpacked)
template <int Bits, bool Signed>
inline void weight_tile(const uint8_t* p, int8_t* buf) {
  const __m512i eight = _mm512_set1_epi8(8);
  for (int i = 0; i < 4; ++i) {
    __m512i a, b;
    unpack4(p, i, a, b);
    if (Signed) a = _mm512_sub_epi8(a, eight), b = _mm512_sub_epi8(b, eight);  // Q4_0: q - 8
    _mm512_store_si512(buf + 128 * i, a);
    _mm512_store_si512(buf + 128 * i + 64, b);
  }
}

struct alignas(64) WeightTile {
  int8_t bytes[512];
};

// The nb weight tiles of one group (512 bytes each, in block order), ready to load: 8-bit codes are
// stored as tiles already; 4-bit ones are unpacked into `buf` once for all the group's activation rows.
template <int Bits, bool Signed>
const int8_t* group_tiles(const uint8_t* codes, int64_t nb, WeightTile* buf) {
  if (Bits == 8) return reinterpret_cast<const int8_t*>(codes);
  for (int64_t b = 0; b < nb; ++b) weight_tile<Bits, Signed>(codes + b * 256, buf[b].bytes);
  return buf[0].bytes;
}

// One block's products for up to two groups into one set of tiles (SUM0, SUM1, ACT). The tile
// intrinsics take their tile numbers as literal register names, hence a macro for the two sets.
#define SPECLM_BLOCK_PRODUCTS(NAME, SUM0, SUM1, ACT)                                  \
  template <bool Signed>                                                              \
  inline void NAME(const int8_t* x, int64_t K, const int8_t* w0, const int8_t* w1) {  \
    _tile_zero(SUM0);                                                                 \
    _tile_loadd(ACT, x, K);                                                           \
    _tile_loadd(2, w0, 64);                                                           \
    if (Signed) _tile_dpbssd(SUM0, ACT, 2);                                           \
    else _tile_dpbsud(SUM0, ACT, 2); /* Q4_1: unsigned codes */                       \
    if (w1 != nullptr) {                                                              \
      _tile_zero(SUM1);                                                               \
      _tile_loadd(4, w1, 64);                                                         \
      if (Signed) _tile_dpbssd(SUM1, ACT, 4);                                         \
      else _tile_dpbsud(SUM1, ACT, 4);                                                \
    }                                                                                 \
  }
SPECLM_BLOCK_PRODUCTS(products_a, 0, 3, 1)
SPECLM_BLOCK_PRODUCTS(products_b, 5, 6, 7)
#undef SPECLM_BLOCK_PRODUCTS

template <int Bits, bool Signed>
void tile_groups(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                 const speclm::TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = K / 32, bytes = Bits == 4 ? 256 : 512;
  thread_local std::vector<WeightTile> buf;
  buf.resize(Bits == 4 ? 2 * nb : 0);
  alignas(64) int32_t sums[2][kTileRows][kCols];
  const uint8_t* codes = w.codes.data_ptr<uint8_t>();
  const float* scale = w.scale.data_ptr<float>();
  const float* minimum = w.minimum.has_value() ? w.minimum->data_ptr<float>() : nullptr;
  int64_t configured = -1;
  for (int64_t g = g0; g < g1; g += 2) {  // two groups of 16 weight rows at a time
    const int64_t groups = std::min<int64_t>(2, g1 - g);
    const int8_t* wt[2] = {group_tiles<Bits, Signed>(codes + g * nb * bytes, nb, buf.data()), nullptr};
    if (groups == 2) wt[1] = group_tiles<Bits, Signed>(codes + (g + 1) * nb * bytes, nb, buf.data() + nb);
    memory_fence();  // the unpacked tiles are in memory before a tile load reads them
    auto products = [&](int64_t b, int64_t m0, bool set_a) {
      const int8_t* x = qx + m0 * K + b * 32;
      const int8_t* w1 = groups == 2 ? wt[1] + b * 512 : nullptr;
      if (set_a) products_a<Signed>(x, K, wt[0] + b * 512, w1);
      else products_b<Signed>(x, K, wt[0] + b * 512, w1);
    };
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, M - m0);
      if (rows != configured) configure(rows), configured = rows;
      __m512 acc[2][kTileRows], offset[2][kTileRows];
      for (int64_t p = 0; p < groups; ++p)
        for (int64_t r = 0; r < rows; ++r) acc[p][r] = offset[p][r] = _mm512_setzero_ps();
      products(0, m0, true);
      for (int64_t b = 0; b < nb; ++b) {
        const bool set_a = b % 2 == 0;
        if (b + 1 < nb) products(b + 1, m0, !set_a);  // the next block's products, while this one's are scaled
        memory_fence();  // the last block's sums are read before these overwrite them
        if (set_a) {
          _tile_stored(0, sums[0], 64);
          if (groups == 2) _tile_stored(3, sums[1], 64);
        } else {
          _tile_stored(5, sums[0], 64);
          if (groups == 2) _tile_stored(6, sums[1], 64);
        }
        memory_fence();  // ... and read after they are written
        for (int64_t p = 0; p < groups; ++p) {
          const int64_t at = ((g + p) * nb + b) * kCols;
          const __m512 ws = _mm512_loadu_ps(scale + at);
          const float* wm = minimum != nullptr ? minimum + at : nullptr;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = (m0 + r) * nb + b;
            scale_block(_mm512_load_si512(sums[p][r]), ws, wm, dx[i], sx[i], acc[p][r], offset[p][r]);
          }
        }
      }
      for (int64_t p = 0; p < groups; ++p)
        store_rows(acc[p], offset[p], rows, y + m0 * ldy + (g + p) * kCols, ldy, std::min(kCols, w.N - (g + p) * kCols));
    }
  }
  _tile_release();
}

#endif  // __AMX_INT8__

}  // namespace

bool speclm::enable_tiles(bool use_amx) {
  tiles_on().store(true);
#if defined(__AMX_INT8__)
  // Linux gives a process the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, 0x1023,
  // for XFEATURE_XTILEDATA, 18); without it the first tile instruction faults.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  amx.store(use_amx && granted);
#endif
  return amx.load();
}

void speclm::tile_product(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                          const TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
#if defined(__AMX_INT8__)
  if (amx.load() && M >= kAmxMinRows) {
    if (w.bits == 8) tile_groups<8, true>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
    else if (!w.minimum.has_value()) tile_groups<4, true>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
    else tile_groups<4, false>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
    return;
  }
#endif
  if (w.bits == 8) vnni_groups<8, true>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
  else if (!w.minimum.has_value()) vnni_groups<4, true>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
  else vnni_groups<4, false>(qx, dx, sx, M, K, w, g0, g1, y, ldy);
}

#else  // built for AVX2 only: the same layout, its products in small_m_tiles_avx2.cpp

bool speclm::enable_tiles(bool) {
  tiles_on().store(true);
  return false;
}

void speclm::tile_product(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                          const TileLayer& w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  avx2_tile_product(qx, dx, sx, M, K, w, g0, g1, y, ldy);
}

#endif

// The layout every build repacks registered layers into (portable C++).
speclm::TileLayer speclm::tile_layer(const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& minimum, int64_t bits) {
  const int64_t N = scale.size(0), nb = scale.size(1), groups = (N + kTileCols - 1) / kTileCols;
  const int64_t bytes = bits == 4 ? 256 : 512, row_bytes = codes.size(1);
  const bool q4_0 = bits == 4 && !minimum.has_value();
  at::Tensor tiles = at::zeros({groups, nb, bytes}, codes.options());
  at::Tensor tile_scale = at::zeros({groups, nb, kTileCols}, scale.options());
  c10::optional<at::Tensor> tile_min;
  if (minimum.has_value()) tile_min = at::zeros({groups, nb, kTileCols}, scale.options());
  const uint8_t* src = codes.data_ptr<uint8_t>();
  uint8_t* dst = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* t = dst + (g * nb + b) * bytes;
        for (int64_t c = 0; c < kTileCols; ++c) {
          const int64_t n = g * kTileCols + c;
          for (int64_t k = 0; k < 32; ++k) {  // input k of the block: tile row k / 4, byte 4c + k % 4
            const int64_t row = k / 4, j = 4 * c + k % 4;
            if (bits == 8) {
              t[row * 64 + j] = n < N ? src[n * row_bytes + b * 32 + k] : 0;
            } else {
              const uint8_t byte = n < N ? src[n * row_bytes + b * 16 + k % 16] : 0;
              const uint8_t code = n < N ? (k < 16 ? byte & 0x0F : byte >> 4) : (q4_0 ? 8 : 0);  // pad: 0
              t[(row / 2) * 64 + j] |= static_cast<uint8_t>(code << (row % 2 ? 4 : 0));
            }
          }
        }
      }
  });
  const float* s = scale.data_ptr<float>();
  const float* mn = minimum.has_value() ? minimum->data_ptr<float>() : nullptr;
  float* ts = tile_scale.data_ptr<float>();
  float* tm = tile_min.has_value() ? tile_min->data_ptr<float>() : nullptr;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = ((n / kTileCols) * nb + b) * kTileCols + n % kTileCols;
      ts[at] = s[n * nb + b];
      if (tm != nullptr) tm[at] = mn[n * nb + b];
    }
  return {tiles, tile_scale, tile_min, bits, N, groups};
}

std::atomic<bool>& speclm::tiles_on() {
  static std::atomic<bool> on{false};
  return on;
}
