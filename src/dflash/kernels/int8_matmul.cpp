// y[M, N] = x[M, K] @ W[N, K]^T with W stored as GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K, see
// gguf_blocks.h), computed with integer dot products: each input row is quantised once per call to blocks of 32
// int8 values with a float32 scale (dx = max |x| / 127 over the block, q = round-to-nearest-even(x * 127 / max |x|)),
// and the weights' raw integers meet each input block in integer dot products (exact, int32), scaled afterwards.
// The weights are never converted to floats; their bits are unpacked in registers (int8_formats.h).
//
// The float side of output y[m, n] is one chain over the input blocks b in order, starting from acc = 0, with
// dot_b = sum_j qw_j qx_j over the block's 32 values (qw: the weights' stored integers), S_b = sum_j qx_j and, for
// Q6_K, dot_b,h and S_b,h the same over the block's half h (values 16 h .. 16 h + 15):
//   Q8_0:        acc = fma(d_b * dx_b, float(dot_b), acc)
//   Q4_0:        acc = fma(d_b * dx_b, float(dot_b - 8 S_b), acc)                    (w = d (q - 8))
//   Q4_1:        acc = fma(d_b * dx_b, float(dot_b), acc);  acc = fma(m_b, dx_b * S_b, acc)
//   Q4_K, Q5_K:  as Q4_1 with d_b = d * sc_i and m_b = -(dmin * m_i), i = b mod 8 the block's sub-block (both
//                products exact in float32)                                          (w = d sc_i q - dmin m_i)
//   Q6_K:        for h = 0, 1: acc = fma(d_b,h * dx_b, float(dot_b,h - 32 S_b,h), acc)
//                with d_b,h = d * sc_(2 (b mod 8) + h) (exact)                       (w = d sc (q - 32))
// (dx_b * S_b is computed once per input block, when the row is quantised.)
// Every path computes exactly this chain per output element: the vector paths (AVX-512 VNNI, AVX-VNNI, AVX2) run
// it for 16 (or 8) weight rows at once, one lane per weight row, after summing each block's (or half block's)
// integer lanes per row; the AMX path (6 or more input rows on CPUs with AMX-INT8 tiles) runs it for 16 input rows
// at once, one lane per input row, on the integer sums of one tile product per block. Integer sums are exact in any
// order. Q6_K, whose scales change every 16 values, stays on the vector path whatever the rows.
//
// Batch invariance: so y[m, n] is bitwise the same whatever M is, which path or tile the row takes, where it sits
// in its tile, or how many threads run. An input row's quantisation depends on that row only. Contraction of
// separate multiplies and adds into FMAs is disabled at build time (-ffp-contract=off); the FMAs are explicit.
//
// ISA (chosen at compile time by -march=native): AVX-512 with VNNI (vpdpbusd on 512 bits, 16 weight rows x a
// block pair per step), else AVX2 + FMA + F16C (8 weight rows x a block; vpdpbusd on 256 bits with AVX-VNNI,
// else vpmaddubsw + vpmaddwd, which cannot overflow here: |products| <= 128 * 127 per pair). With AMX-INT8 as
// well, products of six or more input rows run on the tiles where Linux grants the tile state (arch_prctl).
// `available()` is false without AVX2.
//
// Two parts (`parts` = 2): each input block is rounded twice, x ~ dx (q + low / 256) with low the first rounding's
// residual rounded again to 8 bits (about 15 bits in all), and each product takes two integer dot products,
// 256 (w . q) + (w . low), exact in int32; the chain above then reads that sum (and S = 256 sum q + sum low) with
// the scale dx / 256. The inputs' rounding moves a product about 200 times less than with one part (and less than
// bf16 inputs do), for about the cost of one part on one row. Batch invariant as above: every path forms the same
// integer sum per block.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "int8_formats.h"
#include "kernel_checks.h"

#if defined(DFLASH_INT8_512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define DFLASH_INT8_AMX 1
#include "amx_tiles.h"
#endif

namespace {

#if !defined(DFLASH_INT8_512) && !defined(DFLASH_INT8_256)
constexpr const char* kInt8Isa = "none";
#endif

constexpr int64_t kPadValues = 64;  // input rows are padded with zeros to whole block pairs

// ---------------------------------------------------------------------------------------------------------
// Input rows quantised to int8 blocks.
// ---------------------------------------------------------------------------------------------------------
struct QuantizedRows {
  int64_t rows = 0, k = 0, padded = 0, blocks = 0;  // padded: k rounded up to kPadValues; blocks = padded / 32
  std::vector<int8_t> q;                              // [rows, padded] int8 values (zeros past k)
  std::vector<float> scale;                           // [rows, blocks] dx
  std::vector<float> sum;                             // [rows, blocks] dx * (sum of the block's q)
  std::vector<int32_t> half_total;                    // [rows, blocks * 2] integer sums of each 16-value half
  std::vector<int8_t> low;                            // [rows, padded] second parts (two parts only)

  const int8_t* values(int64_t row) const { return q.data() + row * padded; }
  const int8_t* lows(int64_t row) const { return low.data() + row * padded; }
  const float* scales(int64_t row) const { return scale.data() + row * blocks; }
  const float* sums(int64_t row) const { return sum.data() + row * blocks; }
  const int32_t* half_totals(int64_t row) const { return half_total.data() + row * 2 * blocks; }
};

// One block of 32 floats -> 32 int8 values and their scale (scalar; the reference for `quantize_block`).
inline float quantize_block_scalar(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < kBlockValues; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int j = 0; j < kBlockValues; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
  return amax / 127.0f;
}

#if defined(DFLASH_INT8_512)
// The same values as `quantize_block_scalar` (max is exact; x * inverse is one float32 multiply; conversion
// rounds to nearest even under the default rounding mode, like nearbyint).
inline float quantize_block(const float* x, int8_t* q) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512 scale = _mm512_set1_ps(inverse);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, scale))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, scale))));
  return amax / 127.0f;
}
#else
inline float quantize_block(const float* x, int8_t* q) { return quantize_block_scalar(x, q); }
#endif

// A block's second parts (the first rounding's residual rounded again to 8 bits) and the integer sums of 256 q + low
// over each 16-value half (scalar; the reference for the vector form below).
inline void second_parts_scalar(const float* x, const int8_t* q, float d, float inverse, int8_t* low,
                                int (&halves)[2]) {
  for (int j = 0; j < kBlockValues; ++j) {
    const float residual = x[j] - d * static_cast<float>(q[j]);  // |residual| <= d / 2
    low[j] = static_cast<int8_t>(std::clamp(std::nearbyint(residual * inverse), -127.0f, 127.0f));
    halves[j / 16] += 256 * q[j] + low[j];
  }
}

#if defined(DFLASH_INT8_512)
// The same values: the product and the difference rounded separately (no FMA), the conversion rounding to nearest
// even as nearbyint does, the clamp to [-127, 127] before narrowing; integer sums in any order.
inline void second_parts(const float* x, const int8_t* q, float d, float inverse, int8_t* low, int (&halves)[2]) {
  for (int h = 0; h < 2; ++h) {
    const __m512i qi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
    const __m512 residual =
        _mm512_sub_ps(_mm512_loadu_ps(x + 16 * h), _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(qi)));
    __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(residual, _mm512_set1_ps(inverse)));
    rounded = _mm512_min_epi32(_mm512_max_epi32(rounded, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + 16 * h), _mm512_cvtepi32_epi8(rounded));
    halves[h] += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(qi, 8), rounded));
  }
}
#else
inline void second_parts(const float* x, const int8_t* q, float d, float inverse, int8_t* low, int (&halves)[2]) {
  second_parts_scalar(x, q, d, inverse, low, halves);
}
#endif

// One input row -> its blocks' values, scales, scaled sums and half-block integer sums; with `low` (two parts)
// also the second parts, the scale then being dx / 256 and the sums those of 256 q + low.
void quantize_row(const float* x, int64_t k, int64_t padded, int8_t* q, float* scale, float* sum,
                  int32_t* half_total, int8_t* low) {
  const int64_t blocks = padded / kBlockValues;
  std::memset(q, 0, static_cast<size_t>(padded));
  if (low != nullptr) std::memset(low, 0, static_cast<size_t>(padded));
  std::fill(scale, scale + blocks, 0.0f);
  std::fill(sum, sum + blocks, 0.0f);
  std::fill(half_total, half_total + 2 * blocks, 0);
  for (int64_t b = 0; b < k / kBlockValues; ++b) {
    int8_t* block = q + b * kBlockValues;
    const float* values = x + b * kBlockValues;
    const float d = quantize_block(values, block);
    int halves[2] = {0, 0};
    if (low == nullptr) {
      for (int j = 0; j < kBlockValues; ++j) halves[j / 16] += block[j];
      scale[b] = d;
    } else {
      second_parts(values, block, d, d > 0.0f ? 256.0f / d : 0.0f, low + b * kBlockValues, halves);
      scale[b] = d / 256.0f;
    }
    half_total[2 * b] = halves[0];
    half_total[2 * b + 1] = halves[1];
    sum[b] = scale[b] * static_cast<float>(halves[0] + halves[1]);
  }
}

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int parts) {
  QuantizedRows rows;
  rows.rows = m;
  rows.k = k;
  rows.padded = (k + kPadValues - 1) / kPadValues * kPadValues;
  rows.blocks = rows.padded / kBlockValues;
  rows.q.resize(static_cast<size_t>(m * rows.padded));
  rows.scale.resize(static_cast<size_t>(m * rows.blocks));
  rows.sum.resize(static_cast<size_t>(m * rows.blocks));
  rows.half_total.resize(static_cast<size_t>(m * 2 * rows.blocks));
  if (parts == 2) rows.low.resize(static_cast<size_t>(m * rows.padded));
  const auto work = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_row(x + i * k, k, rows.padded, rows.q.data() + i * rows.padded, rows.scale.data() + i * rows.blocks,
                   rows.sum.data() + i * rows.blocks, rows.half_total.data() + i * 2 * rows.blocks,
                   parts == 2 ? rows.low.data() + i * rows.padded : nullptr);
    }
  };
  if (m >= 32) {
    at::parallel_for(0, m, 16, work);
  } else {
    work(0, m);  // a few rows: cheaper than waking the threads
  }
  return rows;
}

// Weight rows of a group: row r of the group, or the last row of the matrix for rows past its end (computed and
// discarded; every output element is independent of the others).
inline int64_t clamped_row(int64_t first_row, int r, int64_t n) { return std::min<int64_t>(first_row + r, n - 1); }

// Each step asks for the cache line this many weight rows further on: a group's rows are separate streams, more
// than the hardware prefetcher follows at once, and a one-row product waits on memory otherwise.
constexpr int64_t kPrefetchRows = 16;

#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
// Output rows handed to one task at least (so small matrices are not split into tiny pieces).
constexpr int64_t kMinRowsPerTask = 16;

template <class Format>
inline const uint8_t* prefetch_address(const uint8_t* row, int64_t b, int64_t row_bytes) {
  return row + data_offset<Format::kBytes, Format::kValues>(b) + kPrefetchRows * row_bytes;  // past the end: a hint
}
#endif

// ---------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: 16 weight rows (one per lane) x a block pair per step.
// ---------------------------------------------------------------------------------------------------------
#if defined(DFLASH_INT8_512)
// Integer sums of 16 rows' dot-product vectors (lanes 0..7: block b, 8..15: block b + 1) -> (block b's sums,
// block b + 1's sums), lane r = row r. Any order of integer additions gives the same sums.
inline __m512i pair_add(__m512i a, __m512i b) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i quad_add(__m512i a, __m512i b, __m512i c, __m512i d) {  // per 128-bit lane L: [a, b, c, d] sums of L
  const __m512i ab = pair_add(a, b), cd = pair_add(c, d);
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}
inline __m512i halves_add(__m512i v0, __m512i v1) {  // 128-bit lanes [v0 block b, v0 block b+1, v1 b, v1 b+1]
  return _mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline void block_sums(const __m512i (&dots)[kGroupRows], __m512i& first, __m512i& second) {
  const __m512i x01 = halves_add(quad_add(dots[0], dots[1], dots[2], dots[3]), quad_add(dots[4], dots[5], dots[6], dots[7]));
  const __m512i x23 =
      halves_add(quad_add(dots[8], dots[9], dots[10], dots[11]), quad_add(dots[12], dots[13], dots[14], dots[15]));
  first = _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0));
  second = _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1));
}
// The same rows' sums per 16-value quarter of the pair (block b's halves, then block b + 1's), lane r = row r.
inline void quarter_sums(const __m512i (&dots)[kGroupRows], __m512i (&quarters)[4]) {
  // q_i: 128-bit lane L holds rows 4 i .. 4 i + 3's sums of quarter L
  const __m512i q0 = quad_add(dots[0], dots[1], dots[2], dots[3]), q1 = quad_add(dots[4], dots[5], dots[6], dots[7]);
  const __m512i q2 = quad_add(dots[8], dots[9], dots[10], dots[11]),
                q3 = quad_add(dots[12], dots[13], dots[14], dots[15]);
  const __m512i t0 = _mm512_shuffle_i32x4(q0, q1, _MM_SHUFFLE(1, 0, 1, 0));  // [q0 L0, q0 L1, q1 L0, q1 L1]
  const __m512i t1 = _mm512_shuffle_i32x4(q0, q1, _MM_SHUFFLE(3, 2, 3, 2));  // [q0 L2, q0 L3, q1 L2, q1 L3]
  const __m512i t2 = _mm512_shuffle_i32x4(q2, q3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t3 = _mm512_shuffle_i32x4(q2, q3, _MM_SHUFFLE(3, 2, 3, 2));
  quarters[0] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));  // [q0 L0, q1 L0, q2 L0, q3 L0]
  quarters[1] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
  quarters[2] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
  quarters[3] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

// The chain's step for one block (or Q6_K half block), lanes = weight rows: the integer sums less the format's
// offset times the input's integer sum, then acc = fma(d * dx, float(dots), acc) (+ fma(m, dx * S, acc)).
template <class Format>
inline __m512 chain_step(__m512 acc, __m512 d, __m512 m, __m512i dots, float dx, float dx_sum, int32_t total) {
  if constexpr (Format::kOffset != 0) dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(Format::kOffset * total));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(dots), acc);
  if constexpr (Format::kHasMin) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum), acc);
  return acc;
}

// 16 weight rows from `first_row` (rows past n repeat the last) x INPUTS input rows from `first_input`, all of K,
// with inputs of PARTS parts; y: INPUTS rows of n floats.
template <class Format, int INPUTS, int PARTS>
void group_tile(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t n, int64_t first_row,
                const QuantizedRows& x, int64_t first_input, float* y) {
  const uint8_t* rows[kGroupRows];
  alignas(64) int32_t offsets[kGroupRows];
  for (int r = 0; r < kGroupRows; ++r) {
    rows[r] = weights + clamped_row(first_row, r, n) * row_bytes;
    offsets[r] = static_cast<int32_t>(rows[r] - rows[0]);
  }
  const __m512i offset_vector = _mm512_load_si512(offsets);
  __m512 acc[INPUTS];
  for (int c = 0; c < INPUTS; ++c) acc[c] = _mm512_setzero_ps();
  alignas(64) __m512i unpacked[kGroupRows];
  typename Format::Loaded loaded;
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    const int pair = static_cast<int>(b / 2 % Format::kPairsPerLoad);
    if (pair == 0) loaded = Format::load(rows[0], offset_vector, b, two);
    const PairFactors f = Format::pair(loaded, pair);
#pragma GCC unroll 16
    for (int r = 0; r < kGroupRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch_address<Format>(rows[r], b, row_bytes)), _MM_HINT_T0);
      unpacked[r] = Format::unpack(rows[r], b, two);
    }
#pragma GCC unroll 4
    for (int c = 0; c < INPUTS; ++c) {
      const int64_t input = first_input + c;
      const __m512i q = Format::input(_mm512_loadu_si512(x.values(input) + b * kBlockValues));
      __m512i dots[kGroupRows];
      if constexpr (PARTS == 2) {
        const __m512i q_low = Format::input(_mm512_loadu_si512(x.lows(input) + b * kBlockValues));
#pragma GCC unroll 16
        for (int r = 0; r < kGroupRows; ++r) dots[r] = Format::dot2(unpacked[r], q, q_low);
      } else {
#pragma GCC unroll 16
        for (int r = 0; r < kGroupRows; ++r) dots[r] = Format::dot(unpacked[r], q);
      }
      const float* dx = x.scales(input) + b;
      const float* dx_sum = x.sums(input) + b;
      const int32_t* halves = x.half_totals(input) + 2 * b;  // [4]: block b's halves, then block b + 1's
      if constexpr (Format::kHalves) {  // a K format: both blocks are there
        __m512i quarters[4];
        quarter_sums(dots, quarters);
        for (int h = 0; h < 4; ++h) {
          acc[c] = chain_step<Format>(acc[c], f.d[h], f.d[h], quarters[h], dx[h / 2], 0.0f, halves[h]);
        }
      } else {
        __m512i sums0, sums1;
        block_sums(dots, sums0, sums1);
        acc[c] = chain_step<Format>(acc[c], f.d[0], f.m[0], sums0, dx[0], dx_sum[0], halves[0] + halves[1]);
        if (two) acc[c] = chain_step<Format>(acc[c], f.d[1], f.m[1], sums1, dx[1], dx_sum[1], halves[2] + halves[3]);
      }
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, n - first_row));
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  for (int c = 0; c < INPUTS; ++c) _mm512_mask_storeu_ps(y + c * n + first_row, mask, acc[c]);
}

// ---------------------------------------------------------------------------------------------------------
// AVX2 (+ AVX-VNNI): 8 weight rows (one per lane) x a block per step.
// ---------------------------------------------------------------------------------------------------------
#elif defined(DFLASH_INT8_256)
// 8 rows' dot-product vectors of one block -> the block's sums per half (values 0..15, 16..31), lane r = row r.
inline void half_sums(const __m256i (&dots)[kGroupRows], __m256i& first, __m256i& second) {
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[4], dots[5]), _mm256_hadd_epi32(dots[6], dots[7]));
  // low: [rows 0..3, lanes 0..3 | rows 0..3, lanes 4..7]; high: the same for rows 4..7
  first = _mm256_permute2x128_si256(low, high, 0x20);
  second = _mm256_permute2x128_si256(low, high, 0x31);
}

// 256 (w . high) + (w . low), per lane
template <class Format>
inline __m256i dot2(const typename Format::Unpacked& w, __m256i high, __m256i low) {
  return _mm256_add_epi32(_mm256_slli_epi32(Format::dot(w, high), 8), Format::dot(w, low));
}

// The chain's step for one block (or Q6_K half block), lanes = weight rows (as the 512-bit path's).
template <class Format>
inline __m256 chain_step(__m256 acc, __m256 d, __m256 m, __m256i dots, float dx, float dx_sum, int32_t total) {
  if constexpr (Format::kOffset != 0) dots = _mm256_sub_epi32(dots, _mm256_set1_epi32(Format::kOffset * total));
  acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(dots), acc);
  if constexpr (Format::kHasMin) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(dx_sum), acc);
  return acc;
}

template <class Format, int INPUTS, int PARTS>
void group_tile(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t n, int64_t first_row,
                const QuantizedRows& x, int64_t first_input, float* y) {
  const uint8_t* rows[kGroupRows];
  alignas(32) int32_t offsets[kGroupRows];
  for (int r = 0; r < kGroupRows; ++r) {
    rows[r] = weights + clamped_row(first_row, r, n) * row_bytes;
    offsets[r] = static_cast<int32_t>(rows[r] - rows[0]);
  }
  const __m256i offset_vector = _mm256_load_si256(reinterpret_cast<const __m256i*>(offsets));
  __m256 acc[INPUTS];
  for (int c = 0; c < INPUTS; ++c) acc[c] = _mm256_setzero_ps();
  typename Format::Unpacked unpacked[kGroupRows];
  typename Format::Loaded loaded;
  for (int64_t b = 0; b < blocks; ++b) {
    const int step = static_cast<int>(b % Format::kBlocksPerLoad);
    if (step == 0) loaded = Format::load(rows, offset_vector, b);
    const BlockFactors f = Format::block(loaded, step);
#pragma GCC unroll 8
    for (int r = 0; r < kGroupRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch_address<Format>(rows[r], b, row_bytes)), _MM_HINT_T0);
      unpacked[r] = Format::unpack(rows[r], b);
    }
#pragma GCC unroll 4
    for (int c = 0; c < INPUTS; ++c) {
      const int64_t input = first_input + c;
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.values(input) + b * kBlockValues));
      __m256i dots[kGroupRows];
      if constexpr (PARTS == 2) {
        const __m256i q_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.lows(input) + b * kBlockValues));
#pragma GCC unroll 8
        for (int r = 0; r < kGroupRows; ++r) dots[r] = dot2<Format>(unpacked[r], q, q_low);
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < kGroupRows; ++r) dots[r] = Format::dot(unpacked[r], q);
      }
      __m256i first, second;
      half_sums(dots, first, second);
      const float dx = x.scales(input)[b], dx_sum = x.sums(input)[b];
      const int32_t* halves = x.half_totals(input) + 2 * b;
      if constexpr (Format::kHalves) {
        acc[c] = chain_step<Format>(acc[c], f.d[0], f.m, first, dx, dx_sum, halves[0]);
        acc[c] = chain_step<Format>(acc[c], f.d[1], f.m, second, dx, dx_sum, halves[1]);
      } else {
        acc[c] = chain_step<Format>(acc[c], f.d[0], f.m, _mm256_add_epi32(first, second), dx, dx_sum,
                                    halves[0] + halves[1]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kGroupRows, n - first_row);
  for (int c = 0; c < INPUTS; ++c) {
    alignas(32) float out[kGroupRows];
    _mm256_store_ps(out, acc[c]);
    std::memcpy(y + c * n + first_row, out, static_cast<size_t>(valid) * sizeof(float));
  }
}
#endif

#include "int8_panels.h"  // after QuantizedRows and chain_step, which its products use

#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
// Input rows per vector tile beyond one: every group of weight rows is unpacked once per tile.
constexpr int kTileInputs = 4;

template <class Format, int INPUTS, int PARTS>
void group_times_inputs(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t n, int64_t first_row,
                        const QuantizedRows& x, int64_t first_input, int64_t inputs, float* y) {
  int64_t c = 0;
  for (; c + INPUTS <= inputs; c += INPUTS) {
    group_tile<Format, INPUTS, PARTS>(weights, row_bytes, blocks, n, first_row, x, first_input + c, y + c * n);
  }
  if constexpr (INPUTS > 1) {
    if (c < inputs) {
      group_times_inputs<Format, INPUTS - 1, PARTS>(weights, row_bytes, blocks, n, first_row, x, first_input + c,
                                                    inputs - c, y + c * n);
    }
  }
}

// Vector path: groups [group_begin, group_end) of kGroupRows weight rows against every input row.
template <class Format, int PARTS>
void vector_groups(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t n, const QuantizedRows& x,
                   float* y, int64_t group_begin, int64_t group_end) {
  for (int64_t g = group_begin; g < group_end; ++g) {
    group_times_inputs<Format, kTileInputs, PARTS>(weights, row_bytes, blocks, n, g * kGroupRows, x, 0, x.rows, y);
  }
}
#endif

// ---------------------------------------------------------------------------------------------------------
// AMX-INT8: 16 weight rows x 16 input rows per tile product, one block (32 values) per product.
// Tiles: 0 = sums C (16 x 16 int32), 1 = weights A (16 rows x 32 bytes), 2 = inputs B (8 rows x 16 inputs x 4
// bytes, the layout TDPBUSD reads: B[p][4 i + j] = q[input i][4 p + j]).
// ---------------------------------------------------------------------------------------------------------
#if defined(DFLASH_INT8_AMX)
constexpr int kTileRows = 16;
// Tile registers (the intrinsics take them as literals): sums 0/1, weights 2/3, inputs 4/5 of block b (+0) and of
// block b + 1 (+1), so that the product of a pair's second block runs while the first block's sums are scaled.
// With two parts: sums of the first parts 0 (block b) / 6 (block b + 1), of the second parts 1 / 7; inputs 4 (first
// parts) and 5 (second parts), loaded for block b, then again for block b + 1.
constexpr int kSumsTile = 0, kWeightsTile = 2, kInputsTile = 4, kSecondSumsTile = 6;

using dflash_amx::TileConfig;
using dflash_amx::tile_state_granted;

void configure_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int half = 0; half < 2; ++half) {
    config.rows[kSumsTile + half] = kTileRows;  // 16 x 16 int32
    config.colsb[kSumsTile + half] = 64;
    config.rows[kWeightsTile + half] = kTileRows;  // 16 x 32 bytes
    config.colsb[kWeightsTile + half] = kBlockValues;
    config.rows[kInputsTile + half] = kBlockValues / 4;  // 8 x (16 x 4 bytes)
    config.colsb[kInputsTile + half] = 64;
    config.rows[kSecondSumsTile + half] = kTileRows;
    config.colsb[kSecondSumsTile + half] = 64;
  }
  dflash_amx::load_tile_config(config);
}

// Input tiles of every group of 16 input rows and every block, and the rows' scales by block:
// tiles[(g * blocks + b) * 512 ...] (B layout), scales[(g * blocks + b) * 16 + i] = dx of input 16 g + i (sums:
// dx * S, totals: S of the same input and block). With two parts `low_tiles` holds the second parts in the same
// layout.
struct InputTiles {
  int64_t groups = 0, blocks = 0;
  std::vector<int8_t> tiles, low_tiles;
  std::vector<float> scales, sums;
  std::vector<int32_t> totals;
};

InputTiles input_tiles(const QuantizedRows& x, int64_t blocks) {
  InputTiles t;
  t.groups = (x.rows + kTileRows - 1) / kTileRows;
  t.blocks = blocks;
  const bool two = !x.low.empty();
  t.tiles.assign(static_cast<size_t>(t.groups * blocks * 512), 0);
  if (two) t.low_tiles.assign(t.tiles.size(), 0);
  t.scales.assign(static_cast<size_t>(t.groups * blocks * kTileRows), 0.0f);
  t.sums.assign(static_cast<size_t>(t.groups * blocks * kTileRows), 0.0f);
  t.totals.assign(static_cast<size_t>(t.groups * blocks * kTileRows), 0);
  for (int64_t input = 0; input < x.rows; ++input) {
    const int64_t g = input / kTileRows, i = input % kTileRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = (g * blocks + b) * 512;
      const int8_t* q = x.values(input) + b * kBlockValues;
      for (int p = 0; p < kBlockValues / 4; ++p) std::memcpy(t.tiles.data() + at + p * 64 + 4 * i, q + 4 * p, 4);
      if (two) {
        const int8_t* low = x.lows(input) + b * kBlockValues;
        for (int p = 0; p < kBlockValues / 4; ++p) std::memcpy(t.low_tiles.data() + at + p * 64 + 4 * i, low + 4 * p, 4);
      }
      t.scales[(g * blocks + b) * kTileRows + i] = x.scales(input)[b];
      t.sums[(g * blocks + b) * kTileRows + i] = x.sums(input)[b];
      t.totals[(g * blocks + b) * kTileRows + i] = x.half_totals(input)[2 * b] + x.half_totals(input)[2 * b + 1];
    }
  }
  return t;
}

// Sums of block b of the pair (tiles +0) and, if `two`, of block b + 1 (tiles +1), from the unpacked pair.
template <class Format>
inline void tile_products(const int8_t* pair, const int8_t* inputs0, const int8_t* inputs1, bool two) {
  _tile_zero(0);
  _tile_loadd(2, pair, 2 * kBlockValues);
  _tile_loadd(4, inputs0, 64);
  if constexpr (Format::kUnsigned) {
    _tile_dpbusd(0, 2, 4);  // unsigned weights x q (signed)
  } else {
    _tile_dpbssd(0, 2, 4);  // signed x signed
  }
  if (two) {
    _tile_zero(1);
    _tile_loadd(3, pair + kBlockValues, 2 * kBlockValues);
    _tile_loadd(5, inputs1, 64);
    if constexpr (Format::kUnsigned) {
      _tile_dpbusd(1, 3, 5);
    } else {
      _tile_dpbssd(1, 3, 5);
    }
  }
}

// Two parts: the products of both parts of block b (sums in tiles 0 and 1) and, if `two`, of block b + 1 (6, 7).
template <class Format>
inline void tile_products_two_parts(const int8_t* pair, const int8_t* inputs0, const int8_t* lows0,
                                    const int8_t* inputs1, const int8_t* lows1, bool two) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(2, pair, 2 * kBlockValues);
  _tile_loadd(4, inputs0, 64);
  _tile_loadd(5, lows0, 64);
  if constexpr (Format::kUnsigned) {
    _tile_dpbusd(0, 2, 4);
    _tile_dpbusd(1, 2, 5);
  } else {
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 2, 5);
  }
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(3, pair + kBlockValues, 2 * kBlockValues);
    _tile_loadd(4, inputs1, 64);
    _tile_loadd(5, lows1, 64);
    if constexpr (Format::kUnsigned) {
      _tile_dpbusd(6, 3, 4);
      _tile_dpbusd(7, 3, 5);
    } else {
      _tile_dpbssd(6, 3, 4);
      _tile_dpbssd(7, 3, 5);
    }
  }
}

// 16 weight rows from `first_row` against input group g (16 rows; rows past M have zero values).
template <class Format, int PARTS>
void amx_group(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t n, int64_t first_row,
               const InputTiles& inputs, int64_t g, int64_t m, float* y) {
  const uint8_t* rows[kTileRows];
  alignas(64) int32_t offsets[kTileRows];
  for (int r = 0; r < kTileRows; ++r) {
    rows[r] = weights + clamped_row(first_row, r, n) * row_bytes;
    offsets[r] = static_cast<int32_t>(rows[r] - rows[0]);
  }
  const __m512i offset_vector = _mm512_load_si512(offsets);
  // Two slots, so that the tile products of the next pair run while this pair's sums are scaled (reading a tile's
  // stores right after them waits on the tile unit).
  alignas(64) int8_t pair[2][kTileRows][2 * kBlockValues];  // row r: block b's 32 values, then block b + 1's
  alignas(64) int32_t sums[2][2][PARTS][kTileRows * kTileRows];  // [slot][block of the pair][part][r * 16 + input]
  alignas(64) float ds[2][2][kTileRows], ms[2][2][kTileRows];  // [slot][block of the pair][r]: d, m
  typename Format::Loaded loaded;  // the scales of the super-block being issued (K formats), or of the pair
  const auto issue = [&](int64_t b, int slot) {
    const bool two = b + 1 < blocks;
    const int pair_index = static_cast<int>(b / 2 % Format::kPairsPerLoad);
    if (pair_index == 0) loaded = Format::load(rows[0], offset_vector, b, two);
    const PairFactors factors = Format::pair(loaded, pair_index);
    for (int half = 0; half < 2; ++half) {
      _mm512_store_ps(ds[slot][half], factors.d[half]);
      _mm512_store_ps(ms[slot][half], factors.m[half]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch_address<Format>(rows[r], b, row_bytes)), _MM_HINT_T0);
      _mm512_store_si512(pair[slot][r], Format::unpack(rows[r], b, two));
    }
    const int8_t* b_tiles = inputs.tiles.data() + (g * blocks + b) * 512;
    if constexpr (PARTS == 2) {
      const int8_t* b_lows = inputs.low_tiles.data() + (g * blocks + b) * 512;
      tile_products_two_parts<Format>(&pair[slot][0][0], b_tiles, b_lows, b_tiles + 512, b_lows + 512, two);
      _tile_stored(0, sums[slot][0][0], 64);
      _tile_stored(1, sums[slot][0][1], 64);
      if (two) {
        _tile_stored(6, sums[slot][1][0], 64);
        _tile_stored(7, sums[slot][1][1], 64);
      }
    } else {
      tile_products<Format>(&pair[slot][0][0], b_tiles, b_tiles + 512, two);
      _tile_stored(0, sums[slot][0][0], 64);
      if (two) _tile_stored(1, sums[slot][1][0], 64);
    }
  };
  __m512 acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  issue(0, 0);
  for (int64_t b = 0, slot = 0; b < blocks; b += 2, slot ^= 1) {
    if (b + 2 < blocks) issue(b + 2, static_cast<int>(slot ^ 1));
    for (int half = 0; half < (b + 1 < blocks ? 2 : 1); ++half) {
      const int64_t block = b + half;
      const __m512 dx = _mm512_loadu_ps(inputs.scales.data() + (g * blocks + block) * kTileRows);
      const __m512 dx_sum = _mm512_loadu_ps(inputs.sums.data() + (g * blocks + block) * kTileRows);
      const __m512i offsets_of_inputs =  // the format's offset times each input's S (Q4_0)
          _mm512_mullo_epi32(_mm512_set1_epi32(Format::kOffset),
                             _mm512_loadu_si512(inputs.totals.data() + (g * blocks + block) * kTileRows));
      const int32_t* block_sums = sums[slot][half][0];
      const int32_t* low_sums = sums[slot][half][PARTS - 1];
      const float* d = ds[slot][half];
      const float* mins = ms[slot][half];
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {  // the chain's step, lanes = inputs: same operations as chain_step
        __m512i integers = _mm512_load_si512(block_sums + r * kTileRows);
        if constexpr (PARTS == 2) {  // 256 (w . q) + (w . low), as the vector path's dot2
          integers = _mm512_add_epi32(_mm512_slli_epi32(integers, 8), _mm512_load_si512(low_sums + r * kTileRows));
        }
        if constexpr (Format::kOffset != 0) integers = _mm512_sub_epi32(integers, offsets_of_inputs);
        const __m512 dots = _mm512_cvtepi32_ps(integers);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx), dots, acc[r]);
        if constexpr (Format::kHasMin) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mins[r]), dx_sum, acc[r]);
      }
    }
  }
  // acc[r] lane i = y[16 g + i, first_row + r]
  const int64_t valid_rows = std::min<int64_t>(kTileRows, n - first_row);
  const int64_t valid_inputs = std::min<int64_t>(kTileRows, m - g * kTileRows);
  alignas(64) float out[kTileRows][kTileRows];
  for (int r = 0; r < kTileRows; ++r) _mm512_store_ps(out[r], acc[r]);
  for (int64_t i = 0; i < valid_inputs; ++i) {
    float* row = y + (g * kTileRows + i) * n + first_row;
    for (int64_t r = 0; r < valid_rows; ++r) row[r] = out[r][i];
  }
}

template <class Format, int PARTS>
void amx_groups(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t n, const InputTiles& inputs,
                int64_t m, float* y, int64_t group_begin, int64_t group_end) {
  configure_tiles();
  for (int64_t w = group_begin; w < group_end; ++w) {
    for (int64_t g = 0; g < inputs.groups; ++g) {
      amx_group<Format, PARTS>(weights, row_bytes, blocks, n, w * kTileRows, inputs, g, m, y);
    }
  }
  _tile_release();
}

// Input rows from which the tiles take over from the vector path (results are the same either way). A block costs
// the tiles about the same whatever the input rows (a product, its loads and the sums' store: about 130 cycles
// per 16 weight rows), the vector path about 0.5x more per further input row; they meet near 5 input rows.
constexpr int64_t kAmxMinInputs = 6;
#endif

bool tiles_usable() {
#if defined(DFLASH_INT8_AMX)
  return tile_state_granted();
#else
  return false;
#endif
}

}  // namespace

bool available() {
#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
  return true;
#else
  return false;
#endif
}

namespace {

#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
// Calls body(Format{}) with the format trait of `qtype` (checked by `int8_layout` before).
template <class Body>
void with_format(int64_t qtype, Body&& body) {
  switch (qtype) {
    case kTypeQ4_0: body(Q4_0Int8{}); break;
    case kTypeQ4_1: body(Q4_1Int8{}); break;
    case kTypeQ8_0: body(Q8_0Int8{}); break;
    case kTypeQ4_K: body(Q4_KInt8{}); break;
    case kTypeQ5_K: body(Q5_KInt8{}); break;
    case kTypeQ6_K: body(Q6_KInt8{}); break;
    default: ::kernel_checks::refuse("unsupported quantisation type ", qtype);
  }
}
#endif

template <int PARTS>
void products(const QuantizedRows& rows, const uint8_t* weights, int64_t row_bytes, int64_t n_blocks, int64_t n,
              int64_t qtype, bool tiles, float* ys) {
#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
  const int64_t m = rows.rows;
  const int64_t groups = (n + kGroupRows - 1) / kGroupRows;
  const int64_t grain = std::max<int64_t>(1, kMinRowsPerTask / kGroupRows);
  with_format(qtype, [&](auto format) {
    using Format = decltype(format);
#if defined(DFLASH_INT8_AMX)
    if constexpr (Format::kOnTiles) {
      if (tiles && m >= kAmxMinInputs && tiles_usable()) {
        const InputTiles input_groups = input_tiles(rows, n_blocks);
        at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
          amx_groups<Format, PARTS>(weights, row_bytes, n_blocks, n, input_groups, m, ys, begin, end);
        });
        return;
      }
    }
#endif
    (void)tiles, (void)m;
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      vector_groups<Format, PARTS>(weights, row_bytes, n_blocks, n, rows, ys, begin, end);
    });
  });
#else
  (void)rows, (void)weights, (void)row_bytes, (void)n_blocks, (void)n, (void)qtype, (void)tiles, (void)ys;
#endif
}

}  // namespace

torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, bool tiles,
                          int64_t parts) {
  // x: [M, K] float32; blocks: [N, K / (block values) * block bytes] uint8 -> y: [M, N] float32
  DFLASH_CHECK(available(), "int8 products need AVX2 (with FMA and F16C) or AVX-512 VNNI; this build has neither");
  DFLASH_CHECK(parts == 1 || parts == 2, "inputs are rounded to one or two 8-bit parts, not ", parts);
  const auto [input, out] = product_operands(x, blocks, int8_layout(qtype));
  const int64_t m = input.size(0), k = input.size(1), n = blocks.size(0);
  if (m == 0 || n == 0) return out;
  const QuantizedRows rows = quantize_rows(input.data_ptr<float>(), m, k, static_cast<int>(parts));
  const uint8_t* weights = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1), n_blocks = k / kBlockValues;
  if (parts == 2) {
    products<2>(rows, weights, row_bytes, n_blocks, n, qtype, tiles, out.data_ptr<float>());
  } else {
    products<1>(rows, weights, row_bytes, n_blocks, n, qtype, tiles, out.data_ptr<float>());
  }
  return out;
}

bool panels_available() {
#if defined(DFLASH_INT8_512)
  return true;
#else
  return false;
#endif
}

torch::Tensor to_panels(const torch::Tensor& blocks, int64_t qtype) {
  // blocks: [N, K / 32 * block bytes] uint8 (GGUF rows) -> [ceil(N / 16), K / 32 * record bytes] uint8 panels
  const PanelFormat f = panel_format(qtype);
  DFLASH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) % f.source_bytes == 0,
              "blocks must be a contiguous 2-D uint8 CPU tensor of whole blocks");
  const int64_t n = blocks.size(0), n_blocks = blocks.size(1) / f.source_bytes;
  const int64_t groups = (n + kPanelRows - 1) / kPanelRows, group_bytes = n_blocks * f.record_bytes();
  torch::Tensor panels = torch::zeros({groups, group_bytes}, blocks.options());
  const uint8_t* source = blocks.data_ptr<uint8_t>();
  uint8_t* out = panels.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t r = 0; r < kPanelRows && g * kPanelRows + r < n; ++r) {
        const uint8_t* row = source + (g * kPanelRows + r) * blocks.size(1);
        for (int64_t b = 0; b < n_blocks; ++b) {
          block_to_panel(f, row + b * f.source_bytes, r, out + g * group_bytes + b * f.record_bytes());
        }
      }
    }
  });
  return panels;
}

torch::Tensor panel_rows(const torch::Tensor& panels, int64_t qtype, const torch::Tensor& ids) {
  // panels: [groups, K / 32 * record bytes] uint8, ids: [R] int64 row numbers -> [R, K / 32 * block bytes] uint8
  const PanelFormat f = panel_format(qtype);
  DFLASH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kUInt8 && panels.dim() == 2 &&
                  panels.is_contiguous() && panels.size(1) % f.record_bytes() == 0,
              "panels must be a contiguous 2-D uint8 CPU tensor of whole records");
  const torch::Tensor rows = ids.to(torch::kLong).contiguous();
  const int64_t n_blocks = panels.size(1) / f.record_bytes(), count = rows.numel();
  torch::Tensor out = torch::empty({count, n_blocks * f.source_bytes}, panels.options());
  const int64_t* id = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t g = id[i] / kPanelRows, r = id[i] % kPanelRows;
    DFLASH_CHECK(id[i] >= 0 && g < panels.size(0), "row ", id[i], " is outside the panels");
    const uint8_t* group = panels.data_ptr<uint8_t>() + g * panels.size(1);
    for (int64_t b = 0; b < n_blocks; ++b) {
      panel_to_block(f, group + b * f.record_bytes(), r,
                     out.data_ptr<uint8_t>() + i * out.size(1) + b * f.source_bytes);
    }
  }
  return out;
}

torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& panels, int64_t qtype, int64_t n,
                           int64_t parts) {
  // x: [M, K] float32; panels: [ceil(n / 16), K / 32 * record bytes] uint8 (`to_panels`) -> y: [M, n] float32,
  // bitwise `int8_matmul` of the same rows
  DFLASH_CHECK(panels_available(), "panel products need AVX-512 VNNI; this build has ", kInt8Isa);
  DFLASH_CHECK(parts == 1 || parts == 2, "inputs are rounded to one or two 8-bit parts, not ", parts);
  const PanelFormat f = panel_format(qtype);
  DFLASH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  DFLASH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kUInt8 && panels.dim() == 2 &&
                  panels.is_contiguous(), "panels must be a contiguous 2-D uint8 CPU tensor");
  const torch::Tensor input = x.contiguous();
  const int64_t m = input.size(0), k = input.size(1), n_blocks = k / kBlockValues;
  DFLASH_CHECK(k % kBlockValues == 0 && panels.size(1) == n_blocks * f.record_bytes() &&
                  panels.size(0) == (n + kPanelRows - 1) / kPanelRows,
              "panels [", panels.size(0), ", ", panels.size(1), "] do not hold ", n, " rows of ", k, " values");
  torch::Tensor out = torch::empty({m, n}, input.options());
  if (m == 0 || n == 0) return out;
#if defined(DFLASH_INT8_512)
  const QuantizedRows rows = quantize_rows(input.data_ptr<float>(), m, k, static_cast<int>(parts));
  const uint8_t* weights = panels.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t groups = panels.size(0), grain = std::max<int64_t>(1, kMinRowsPerTask / kPanelRows);
  const auto run = [&](auto qtype_constant, auto parts_constant) {
    constexpr int64_t kQtype = decltype(qtype_constant)::value;
    constexpr int kParts = decltype(parts_constant)::value;
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      panel_groups<kQtype, kParts>(weights, n_blocks, n, rows, y, begin, end);
    });
  };
  const auto with_parts = [&](auto qtype_constant) {
    if (parts == 2) {
      run(qtype_constant, std::integral_constant<int, 2>{});
    } else {
      run(qtype_constant, std::integral_constant<int, 1>{});
    }
  };
  if (qtype == kTypeQ4_0) with_parts(std::integral_constant<int64_t, kTypeQ4_0>{});
  if (qtype == kTypeQ4_1) with_parts(std::integral_constant<int64_t, kTypeQ4_1>{});
  if (qtype == kTypeQ8_0) with_parts(std::integral_constant<int64_t, kTypeQ8_0>{});
#endif
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> quantize(const torch::Tensor& x) {
  // x: [M, K] float32 -> (q: [M, K] int8, scales: [M, K / 32] float32), as the products quantise their inputs
  DFLASH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  DFLASH_CHECK(x.size(1) % kBlockValues == 0, "row length ", x.size(1), " is not a multiple of ", kBlockValues);
  const torch::Tensor input = x.contiguous();
  const int64_t m = input.size(0), k = input.size(1);
  const QuantizedRows rows = quantize_rows(input.data_ptr<float>(), m, k, 1);
  torch::Tensor q = torch::empty({m, k}, torch::TensorOptions().dtype(torch::kInt8));
  torch::Tensor scales = torch::empty({m, k / kBlockValues}, torch::TensorOptions().dtype(torch::kFloat32));
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(q.data_ptr<int8_t>() + i * k, rows.values(i), static_cast<size_t>(k));
    std::memcpy(scales.data_ptr<float>() + i * (k / kBlockValues), rows.scales(i),
                static_cast<size_t>(k / kBlockValues) * sizeof(float));
  }
  return {q, scales};
}

bool has_tiles() { return tiles_usable(); }

std::string isa() { return kInt8Isa; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.doc() = "Matrix products with GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights and int8-quantised "
                 "inputs (integer dot products, batch invariant)";
  module.def("matmul", &int8_matmul, "y[M, N] = int8(x)[M, K] @ dequant(blocks)[N, K]^T", py::arg("x"),
             py::arg("blocks"), py::arg("qtype"), py::arg("tiles") = true, py::arg("parts") = 1,
             py::call_guard<py::gil_scoped_release>());
  module.def("panels_available", &panels_available, "whether this build's products read weight panels");
  module.def("to_panels", &to_panels, "GGUF rows [N, bytes] -> weight panels [ceil(N / 16), ...] (int8_panels.h)",
             py::arg("blocks"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  module.def("panel_rows", &panel_rows, "the GGUF rows `ids` of weight panels", py::arg("panels"), py::arg("qtype"),
             py::arg("ids"), py::call_guard<py::gil_scoped_release>());
  module.def("panel_matmul", &panel_matmul, "y[M, n] = int8(x)[M, K] @ dequant(panels)[n, K]^T, bitwise `matmul`",
             py::arg("x"), py::arg("panels"), py::arg("qtype"), py::arg("n"), py::arg("parts") = 1,
             py::call_guard<py::gil_scoped_release>());
  module.def("quantize", &quantize, "x [M, K] -> (int8 [M, K], scales [M, K / 32]) as the products quantise x",
             py::arg("x"), py::call_guard<py::gil_scoped_release>());
  module.def("available", &available, "whether this build has an integer dot product path");
  module.def("has_tiles", &has_tiles, "whether products of several input rows run on AMX-INT8 tiles here");
  module.def("isa", &isa, "the instruction set this build uses: avx512-vnni, avx-vnni, avx2 or none");
  // for the native decoder layers (cpu_decoder.cpp), which call this very function
  module.attr("matmul_capsule") = py::capsule(reinterpret_cast<void*>(&int8_matmul), "dflash.int8_matmul");
  module.attr("panel_matmul_capsule") = py::capsule(reinterpret_cast<void*>(&panel_matmul), "dflash.panel_matmul");
}
