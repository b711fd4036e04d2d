// speclm: a GGUF file's Q4_0/Q4_1/Q8_0 blocks times activations quantized to 8 bits, with the
// integer dot products llama.cpp's CPU kernels use, for CPUs with AVX2: the loop of unregistered
// calls (small_m_blocks_q8). Registered layers are repacked once into the tile layout and run on
// small_m_tiles.cpp's products (AVX-512 VNNI, AMX) or small_m_tiles_avx2.cpp's (AVX2) instead.
//
// small_m.cpp's small_m_blocks decodes each block's codes to floats and multiplies float
// activations: about 14 instructions per 32 weights and row. Here each activation row is first
// quantized per block of 32 inputs as llama.cpp quantizes it for these weight types (q = x * 127 /
// max|x| rounded to the nearest integer, ties to even; d = max|x| / 127 kept in half precision,
// as llama.cpp stores it; for Q4_1 also s = d * sum(q), in half precision), then every block is
// one integer dot product of 32 byte pairs (vpmaddubsw, vpmaddwd), converted to float and scaled
// by d_w * d_x: about half the instructions. The result is what llama.cpp computes for these
// blocks, up to the order of the float sums: not the float product of small_m_blocks.
//
// As everywhere in speclm's kernels, every output is summed in one fixed order (blocks in input
// order into 8 lanes, then a fixed tree), so a row's result is the same alone or among others.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "small_m.h"

namespace {

inline float half_rounded(float v) { return static_cast<float>(c10::Half(v)); }

// Q4_0: signed codes q - 8; Q4_1: unsigned codes q, plus the block's minimum times sum(x);
// Q8_0: signed codes. load() gives the 32 codes of a block in input order.
struct Q41 {
  static constexpr int64_t kBytes = 16;
  static constexpr bool kSigned = false;
  static inline __m256i load(const uint8_t* p) {  // byte j: input j (low nibble), j + 16 (high)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
  }
};
struct Q40 {
  static constexpr int64_t kBytes = 16;
  static constexpr bool kSigned = true;
  static inline __m256i load(const uint8_t* p) { return _mm256_sub_epi8(Q41::load(p), _mm256_set1_epi8(8)); }
};
struct Q80 {
  static constexpr int64_t kBytes = 32;
  static constexpr bool kSigned = true;
  static inline __m256i load(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
};

// x [M, K] float -> q [M, K] int8, d and s [M, K / 32] (block scale, scale * sum of codes).
void quantize_rows(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * 32;
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float amax = _mm_cvtss_f32(m);
    const float scale = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    __m256i n[4];
    for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest, ties to even
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    // int32 x 32 -> int8 x 32 in input order (the packs interleave 128-bit lanes; the permute undoes it)
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * 32), packed);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    d[i] = half_rounded(scale);
    s[i] = half_rounded(scale * static_cast<float>(_mm_cvtsi128_si32(t)));
  }
}

// out[r * ldo] for R quantized rows (codes qx [R, K], scales dx, sums sx [R, nb]) and one weight row.
template <class Block, int R>
inline void q8_rows(const int8_t* qx, const float* dx, const float* sx, const uint8_t* codes,
                    const float* scale, const float* minimum, int64_t nb, float* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float offset[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); offset[r] = 0.0f; }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = Block::load(codes + b * Block::kBytes);
    const __m256i w_abs = Block::kSigned ? _mm256_sign_epi8(w, w) : w;  // vpmaddubsw's unsigned side
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * nb * 32 + b * 32));
      if (Block::kSigned) x = _mm256_sign_epi8(x, w);  // |w| * (x * sign(w)) = w * x
      const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x), ones);  // [8] int32
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_set1_ps(scale[b] * dx[r * nb + b]), acc[r]);
      if (!Block::kSigned) offset[r] = std::fma(minimum[b], sx[r * nb + b], offset[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r * ldo] = speclm::reduce(acc[r]) + offset[r];
}

// A layer's blocks as the kernels read them; minimum is null for Q4_0 and Q8_0.
struct Blocks {
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  int64_t bits, N;
};

// Activation rows quantized for the blocks: codes q [M, K], scales d and sums s [M, K / 32], in this
// thread's scratch (no allocation per call: ~200 calls a step), valid until its next quantize.
struct Quantized {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t M, K;
};

Quantized quantize(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> dx, sx;
  qx.resize(M * K);
  dx.resize(M * nb);
  sx.resize(M * nb);
  quantize_rows(x.data_ptr<float>(), M * nb, qx.data(), dx.data(), sx.data());
  return {qx.data(), dx.data(), sx.data(), M, K};
}

template <class Block>
void q8_range(const Quantized& x, const Blocks& w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t nb = x.K / 32, row_bytes = nb * Block::kBytes;
  speclm::row_groups(x.M, n0, n1, [&](auto R, int64_t m, int64_t n) {
    q8_rows<Block, decltype(R)::value>(x.q + m * x.K, x.d + m * nb, x.s + m * nb,
                                       w.codes + n * row_bytes, w.scale + n * nb,
                                       w.minimum == nullptr ? nullptr : w.minimum + n * nb, nb, y + m * ldy + n, ldy);
  });
}

// y [M, N] (rows ldy floats apart) columns n0 .. n1 - 1 = x times the weight rows n0 .. n1 - 1 of w.
void q8_columns(const Quantized& x, const Blocks& w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (w.bits == 4 && w.minimum == nullptr)
    q8_range<Q40>(x, w, n0, n1, y, ldy);
  else if (w.bits == 4)
    q8_range<Q41>(x, w, n0, n1, y, ldy);
  else
    q8_range<Q80>(x, w, n0, n1, y, ldy);
}

Blocks blocks_of(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& minimum,
                 int64_t bits) {
  return {codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
          minimum.has_value() ? minimum->data_ptr<float>() : nullptr, bits, codes.size(0)};
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              op, ": x is float32 [M, K] on the CPU");
}

}  // namespace

at::Tensor speclm::small_m_blocks_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                     const c10::optional<at::Tensor>& minimum, int64_t bits) {
  check_rows(x, "small_m_blocks_q8");
  speclm::check_blocks(codes, scale, minimum, bits, x.size(1));
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous();
  const c10::optional<at::Tensor> mc =
      minimum.has_value() ? c10::optional<at::Tensor>(minimum->contiguous()) : c10::nullopt;
  const Quantized xq = quantize(xc);
  const Blocks w = blocks_of(cc, sc, mc, bits);
  at::Tensor y = at::empty({xq.M, w.N}, xc.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) { q8_columns(xq, w, n0, n1, yp, w.N); });
  return y;
}

// ---- block layers registered once ------------------------------------------------------------
//
// A compiled step hands every tensor it reads to TorchDynamo's guards at each call (about 2 us
// each): the ~630 code, scale and minimum tensors of the default model's layers cost more than
// the step's attention. A layer registered here is one integer for the graph instead.
namespace {

struct BlockLayer {
  at::Tensor codes, scale;
  c10::optional<at::Tensor> minimum;
  int64_t bits;
  c10::optional<speclm::TileLayer> tiles;  // repacked where tiles were on at registration (every build once
                                           // the kernels are loaded): every 8-bit call uses them
};

std::mutex registry_mutex;
std::unordered_map<int64_t, BlockLayer> registry;
int64_t next_handle = 1;

int64_t register_blocks(const at::Tensor& codes, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& minimum, int64_t bits) {
  speclm::check_blocks(codes, scale, minimum, bits, scale.size(1) * 32);
  BlockLayer layer{codes.contiguous(), scale.contiguous(),
                   minimum.has_value() ? c10::optional<at::Tensor>(minimum->contiguous()) : c10::nullopt, bits,
                   c10::nullopt};
  if (speclm::tiles_on().load()) layer.tiles = speclm::tile_layer(layer.codes, layer.scale, layer.minimum, bits);
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_handle, std::move(layer));
  return next_handle++;
}

void release_blocks(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
}

BlockLayer registered(int64_t handle) {  // the caller holds registry_mutex
  const auto found = registry.find(handle);
  TORCH_CHECK(found != registry.end(), "speclm: no block layer ", handle, " is registered");
  return found->second;
}

// x times each of `layers` (all reading x), with 8-bit activations: x quantized once, all their
// weight rows in one parallel loop; on the tile layout where the layers were repacked for it.
// One output [M, N_0 + N_1 + ...]: layer i's columns follow layer i - 1's.
at::Tensor q8_product(const at::Tensor& x, const std::vector<BlockLayer>& layers, const char* op) {
  check_rows(x, op);
  const at::Tensor xc = x.contiguous();
  const bool tiled = layers.front().tiles.has_value();
  std::vector<int64_t> column{0};  // layer i's first output column
  std::vector<int64_t> start{0};  // layer i's units (weight rows, or groups of 16 of them on tiles)
  for (const BlockLayer& layer : layers) {
    TORCH_CHECK(layer.scale.size(1) * 32 == xc.size(1), op, ": a layer's input size is ", layer.scale.size(1) * 32,
                ", x has ", xc.size(1));
    TORCH_CHECK(layer.tiles.has_value() == tiled, op, ": layers registered with and without the tile layout");
    column.push_back(column.back() + layer.scale.size(0));
    start.push_back(start.back() + (tiled ? layer.tiles->groups : layer.scale.size(0)));
  }
  at::Tensor out = at::empty({xc.size(0), column.back()}, xc.options());
  float* const y = out.data_ptr<float>();
  const int64_t ldy = column.back();
  std::vector<Blocks> blocks;
  if (!tiled)
    for (const BlockLayer& layer : layers) blocks.push_back(blocks_of(layer.codes, layer.scale, layer.minimum, layer.bits));
  const Quantized xq = quantize(xc);
  at::parallel_for(0, start.back(), tiled ? 1 : 16, [&](int64_t u0, int64_t u1) {
    for (size_t i = 0; i < layers.size(); ++i) {
      const int64_t lo = std::max(u0, start[i]) - start[i], hi = std::min(u1, start[i + 1]) - start[i];
      if (lo >= hi) continue;
      if (tiled) speclm::tile_product(xq.q, xq.d, xq.s, xq.M, xq.K, *layers[i].tiles, lo, hi, y + column[i], ldy);
      else q8_columns(xq, blocks[i], lo, hi, y + column[i], ldy);
    }
  });
  return out;
}

at::Tensor registered_blocks(const at::Tensor& x, int64_t handle, bool q8) {
  BlockLayer layer;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    layer = registered(handle);
  }
  if (q8 && layer.tiles.has_value()) return q8_product(x, {layer}, "registered_blocks");
  return q8 ? speclm::small_m_blocks_q8(x, layer.codes, layer.scale, layer.minimum, layer.bits)
            : speclm::small_m_blocks(x, layer.codes, layer.scale, layer.minimum, layer.bits);
}

// The layers of `handles` (all 8-bit-activation layers reading the same input, such as a decoder
// layer's query, key and value projections) in one call: [M, N_0 + N_1 + ...], each layer's
// columns with the bits of registered_blocks(x, handle, true).
at::Tensor registered_blocks_group(const at::Tensor& x, at::IntArrayRef handles) {
  TORCH_CHECK(!handles.empty(), "registered_blocks_group: no layers");
  std::vector<BlockLayer> layers;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (const int64_t handle : handles) layers.push_back(registered(handle));
  }
  return q8_product(x, layers, "registered_blocks_group");
}

}  // namespace


TORCH_LIBRARY_FRAGMENT(speclm, m) {
  m.def("small_m_blocks_q8(Tensor x, Tensor codes, Tensor scale, Tensor? minimum, int bits) -> Tensor");
  m.def("register_blocks(Tensor codes, Tensor scale, Tensor? minimum, int bits) -> int");
  m.def("release_blocks(int handle) -> ()", &release_blocks);
  m.def("registered_blocks(Tensor x, int handle, bool q8) -> Tensor");
  m.def("registered_blocks_group(Tensor x, int[] handles) -> Tensor");
}
TORCH_LIBRARY_IMPL(speclm, CPU, m) {
  m.impl("small_m_blocks_q8", &speclm::small_m_blocks_q8);
  m.impl("register_blocks", &register_blocks);
  m.impl("registered_blocks", &registered_blocks);
  m.impl("registered_blocks_group", &registered_blocks_group);
}
TORCH_LIBRARY_FRAGMENT(speclm, m) {
  m.def("enable_tiles(bool use_amx) -> bool", &speclm::enable_tiles);
}
