// How many 8-bit multiply-adds per second one core's AVX2 integer instructions reach on their own:
// the ceiling for speclm's AVX2 block product (src/speclm/models/small_m_tiles_avx2.cpp), whose
// inner loop is these instructions plus a float part per block (scale, convert, two FMAs).
//
//     g++ -O3 -mavx2 -mfma benchmarks/int8_peak.cpp -o /tmp/int8_peak && /tmp/int8_peak
//
// Each "unit" is the kernel's integer work for one activation row, one block of 32 inputs and 8
// weight rows: 8 vpmaddubsw (4-bit codes times 4 activation bytes for all 8 weight rows), 7 16-bit
// adds and one vpmaddwd, 256 multiply-adds. Weights stay in registers and 4 activation rows run
// interleaved, so nothing but the instructions bound it. Two forms of the activations:
//   broadcast: 4 bytes broadcast to a register before each vpmaddubsw (what the kernel does);
//   expanded:  the broadcasts stored beforehand, read as vpmaddubsw's memory operand.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kBlocks = 16, kRows = 4;
alignas(64) int8_t act[kBlocks * kRows * 32];         // [block, row, 32]
alignas(64) int8_t expanded[kBlocks * kRows * 256];  // [block, row, 8 x 32]: each 4 bytes x 8

template <bool Expanded>
double gmacs(long units) {
  __m256i w[8];
  for (int i = 0; i < 8; ++i) w[i] = _mm256_set1_epi8(static_cast<char>(i + 1));
  __m256i acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const long iters = units / kRows;
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it) {
    const int block = static_cast<int>(it % kBlocks);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const int at = block * kRows + r;
      auto activations = [&](int i) {  // activation bytes 4i .. 4i + 3 of this row and block, in all 8 lanes
        if (Expanded) return _mm256_load_si256(reinterpret_cast<const __m256i*>(expanded + at * 256 + 32 * i));
        int32_t four;
        std::memcpy(&four, act + at * 32 + 4 * i, 4);
        return _mm256_set1_epi32(four);
      };
      __m256i pairs = _mm256_maddubs_epi16(w[0], activations(0));
#pragma GCC unroll 7
      for (int i = 1; i < 8; ++i) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[i], activations(i)));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int32_t out[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3])));
  if (out[0] == 42) std::puts("");  // keep the sums alive
  return static_cast<double>(iters) * kRows * 256 / seconds / 1e9;
}

}  // namespace

int main() {
  for (int i = 0; i < static_cast<int>(sizeof act); ++i) act[i] = static_cast<int8_t>(i * 7 % 255 - 127);
  for (int i = 0; i < static_cast<int>(sizeof expanded); ++i) {
    const int block_row = i / 256, k = (i % 256) / 32, lane = i % 4;
    expanded[i] = act[block_row * 32 + 4 * k + lane];
  }
  const long units = 200'000'000;
  std::printf("one core, 8-bit multiply-adds per second (GMAC/s), 3 runs:\n");
  for (int run = 0; run < 3; ++run)
    std::printf("  broadcast %.1f   expanded %.1f\n", gmacs<false>(units / 8), gmacs<true>(units / 8));
  return 0;
}
