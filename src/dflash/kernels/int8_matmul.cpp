// y[M, N] = x[M, K] @ W[N, K]^T with W stored as GGUF blocks (Q4_1 or Q8_0, see gguf_blocks.h), computed with
// integer dot products: each input row is quantised once per call to blocks of 32 int8 values with a float32
// scale (dx = max |x| / 127 over the block, q = round-to-nearest-even(x * 127 / max |x|)), and each weight block
// meets each input block in one integer dot product of its raw values, scaled afterwards:
//   Q8_0 block:  sum_j (dw qw_j) (dx qx_j)       = dw dx sum_j qw_j qx_j
//   Q4_1 block:  sum_j (dw qw_j + mw) (dx qx_j)  = dw dx sum_j qw_j qx_j + mw dx sum_j qx_j
// The weights are never converted to floats; the nibbles are unpacked in registers.
//
// Lanes: an integer dot product instruction sums 4 adjacent byte products into one int32 lane, so a block of 32
// values fills 8 lanes. The float side works per lane: lane l of block b adds dw_b dx_b dot_l (+ mw_b s_l with
// s_l = dx_b (sum of the lane's 4 qx), for Q4_1) into a float32 accumulator lane; the input side of each lane
// (dx_b, s_l) is computed once per row and call, in `quantize_rows`.
//
// Batch invariance: every output y[m, n] is accumulated by one code path in one order whatever M is, how rows
// are grouped into register tiles, or how many threads run: the integer dot products are exact, the float
// operations of each (weight row, input row) accumulator are the same sequence over the blocks in order (a
// block pair per step, a half-empty pair at the end where the block count is odd), and the accumulator lanes
// are reduced in a fixed order. An input row's quantisation depends on that row only. Row m of an M-row
// product is therefore bitwise equal to the product of that row alone. Contraction of separate multiplies and
// adds into FMAs is disabled at build time (-ffp-contract=off); the FMAs used here are explicit.
//
// ISA (chosen at compile time by -march=native): AVX-512 with VNNI (vpdpbusd on 512 bits, a block pair per
// step), else AVX2 + FMA + F16C (a block per step; vpdpbusd on 256 bits with AVX-VNNI, else vpmaddubsw +
// vpmaddwd, which cannot overflow here: |products| <= 128 * 127 per pair). `available()` is false elsewhere.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gguf_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH_INT8_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DFLASH_INT8_256 1
#endif

namespace {

constexpr int64_t kLaneValues = 4;     // byte products summed into one int32 lane
constexpr int64_t kPadValues = 64;     // input rows are padded with zeros to whole block pairs

// ---------------------------------------------------------------------------------------------------------
// Input rows quantised to int8 blocks, with the per-lane float factors the products need.
// ---------------------------------------------------------------------------------------------------------
struct QuantizedRows {
  int64_t rows = 0, k = 0, padded = 0;  // padded: k rounded up to kPadValues
  std::vector<int8_t> q;                // [rows, padded] int8 values (zeros past k)
  std::vector<float> scale;             // [rows, padded / 32] dx per block
  std::vector<float> lane_scale;        // [rows, padded / 4] dx of the lane's block
  std::vector<float> lane_sum;          // [rows, padded / 4] dx * (sum of the lane's 4 values)

  const int8_t* values(int64_t row) const { return q.data() + row * padded; }
  const float* scales(int64_t row) const { return lane_scale.data() + row * (padded / kLaneValues); }
  const float* sums(int64_t row) const { return lane_sum.data() + row * (padded / kLaneValues); }
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

void quantize_row(const float* x, int64_t k, int64_t padded, int8_t* q, float* scale, float* lane_scale,
                  float* lane_sum) {
  std::memset(q, 0, static_cast<size_t>(padded));
  std::fill(scale, scale + padded / kBlockValues, 0.0f);
  std::fill(lane_scale, lane_scale + padded / kLaneValues, 0.0f);
  std::fill(lane_sum, lane_sum + padded / kLaneValues, 0.0f);
  for (int64_t b = 0; b < k / kBlockValues; ++b) {
    const float d = quantize_block(x + b * kBlockValues, q + b * kBlockValues);
    scale[b] = d;
    for (int64_t l = 0; l < kBlockValues / kLaneValues; ++l) {
      const int8_t* lane = q + b * kBlockValues + l * kLaneValues;
      const int sum = lane[0] + lane[1] + lane[2] + lane[3];
      lane_scale[b * 8 + l] = d;
      lane_sum[b * 8 + l] = d * static_cast<float>(sum);
    }
  }
}

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k) {
  QuantizedRows rows;
  rows.rows = m;
  rows.k = k;
  rows.padded = (k + kPadValues - 1) / kPadValues * kPadValues;
  const int64_t padded = rows.padded;
  rows.q.resize(static_cast<size_t>(m * padded));
  rows.scale.resize(static_cast<size_t>(m * padded / kBlockValues));
  rows.lane_scale.resize(static_cast<size_t>(m * padded / kLaneValues));
  rows.lane_sum.resize(static_cast<size_t>(m * padded / kLaneValues));
  const auto work = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_row(x + i * k, k, padded, rows.q.data() + i * padded, rows.scale.data() + i * padded / kBlockValues,
                   rows.lane_scale.data() + i * padded / kLaneValues, rows.lane_sum.data() + i * padded / kLaneValues);
    }
  };
  if (m >= 32) {
    at::parallel_for(0, m, 16, work);
  } else {
    work(0, m);  // a few rows: cheaper than waking the threads
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------------------
// Per-ISA steps. A step covers kStepBlocks blocks of one weight row ("Chunk": its integer operand and scales)
// and adds their products with one input row into a float accumulator.
// ---------------------------------------------------------------------------------------------------------
#if defined(DFLASH_INT8_512)
constexpr const char* kInt8Isa = "avx512-vnni";
constexpr int64_t kStepBlocks = 2;
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }

inline float acc_reduce(Acc acc) {
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), upper);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// [a x 8, b x 8] from the two floats at positions i, j of v
inline __m512 spread_pair(__m128 v, int i, int j) {
  const __m512i index = _mm512_set_epi32(j, j, j, j, j, j, j, j, i, i, i, i, i, i, i, i);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v));
}

struct Q4_1Int8 {
  static constexpr int64_t kBytes = Q4_1::kBytes;
  struct Chunk {
    __m512i w;   // 64 nibbles as bytes: block 0 values 0..31, block 1 values 0..31
    __m512 d, m;  // dw, mw of each lane's block
  };
  // Blocks at `block` (and `block + kBytes` if `two`); a missing second block is zeros.
  static inline Chunk load(const uint8_t* block, bool two) {
    const __m128i n0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i n1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kBytes + 4)) : _mm_setzero_si128();
    const __m512i both = _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(n0), n1, 1));
    // 128-bit lanes [n0, n0, n1, n1]; the second copy of each shifted down by a nibble
    const __m512i spread = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), both);
    const __m512i shifted = _mm512_srlv_epi64(spread, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    uint32_t s0, s1 = 0;
    std::memcpy(&s0, block, 4);
    if (two) std::memcpy(&s1, block + kBytes, 4);
    const __m128 scales = _mm_cvtph_ps(_mm_setr_epi32(static_cast<int>(s0), static_cast<int>(s1), 0, 0));  // d0 m0 d1 m1
    return {_mm512_and_si512(shifted, _mm512_set1_epi8(0x0F)), spread_pair(scales, 0, 2), spread_pair(scales, 1, 3)};
  }
  static inline void add(Acc& acc, const Chunk& w, const int8_t* xq, const float* x_scale, const float* x_sum) {
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.w, _mm512_loadu_si512(xq));
    const __m512 scale = _mm512_mul_ps(w.d, _mm512_loadu_ps(x_scale));
    acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc);
    acc = _mm512_fmadd_ps(w.m, _mm512_loadu_ps(x_sum), acc);
  }
};

struct Q8_0Int8 {
  static constexpr int64_t kBytes = Q8_0::kBytes;
  struct Chunk {
    __m512i w;          // |qw| as unsigned bytes (vpdpbusd's unsigned operand)
    __mmask64 negative;  // lanes where qw < 0: the input's sign is flipped there
    __m512 d;
  };
  static inline Chunk load(const uint8_t* block, bool two) {
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    const __m256i q1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kBytes + 2))
                           : _mm256_setzero_si256();
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
    const uint16_t h0 = load_u16(block), h1 = two ? load_u16(block + kBytes) : 0;
    const __m128 scales = _mm_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(h0), static_cast<int16_t>(h1), 0, 0, 0, 0, 0, 0));
    return {_mm512_abs_epi8(q), _mm512_movepi8_mask(q), spread_pair(scales, 0, 1)};
  }
  static inline void add(Acc& acc, const Chunk& w, const int8_t* xq, const float* x_scale, const float* /*x_sum*/) {
    const __m512i x = _mm512_loadu_si512(xq);
    const __m512i signed_x = _mm512_mask_sub_epi8(x, w.negative, _mm512_setzero_si512(), x);
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.w, signed_x);
    const __m512 scale = _mm512_mul_ps(w.d, _mm512_loadu_ps(x_scale));
    acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc);
  }
};

#elif defined(DFLASH_INT8_256)
#if defined(__AVXVNNI__)
constexpr const char* kInt8Isa = "avx-vnni";
inline __m256i dot_u8_s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#else
constexpr const char* kInt8Isa = "avx2";
// |u * s| <= 128 * 127 per byte pair here (nibbles, or |qw| <= 128 against |qx| <= 127): no int16 saturation
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif
constexpr int64_t kStepBlocks = 1;
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }

inline float acc_reduce(Acc acc) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

struct Q4_1Int8 {
  static constexpr int64_t kBytes = Q4_1::kBytes;
  struct Chunk {
    __m256i w;  // 32 nibbles as bytes
    __m256 d, m;
  };
  static inline Chunk load(const uint8_t* block, bool /*two*/) {
    const __m256i spread = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    const __m256i shifted = _mm256_srlv_epi64(spread, _mm256_setr_epi64x(0, 0, 4, 4));
    return {_mm256_and_si256(shifted, _mm256_set1_epi8(0x0F)), _mm256_set1_ps(half_to_float(load_u16(block))),
            _mm256_set1_ps(half_to_float(load_u16(block + 2)))};
  }
  static inline void add(Acc& acc, const Chunk& w, const int8_t* xq, const float* x_scale, const float* x_sum) {
    const __m256i dot = dot_u8_s8(w.w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
    const __m256 scale = _mm256_mul_ps(w.d, _mm256_loadu_ps(x_scale));
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc);
    acc = _mm256_fmadd_ps(w.m, _mm256_loadu_ps(x_sum), acc);
  }
};

struct Q8_0Int8 {
  static constexpr int64_t kBytes = Q8_0::kBytes;
  struct Chunk {
    __m256i q, w;  // qw, |qw|
    __m256 d;
  };
  static inline Chunk load(const uint8_t* block, bool /*two*/) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    return {q, _mm256_abs_epi8(q), _mm256_set1_ps(half_to_float(load_u16(block)))};
  }
  static inline void add(Acc& acc, const Chunk& w, const int8_t* xq, const float* x_scale, const float* /*x_sum*/) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    const __m256i dot = dot_u8_s8(w.w, _mm256_sign_epi8(x, w.q));
    const __m256 scale = _mm256_mul_ps(w.d, _mm256_loadu_ps(x_scale));
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc);
  }
};
#endif

#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
constexpr int64_t kStepValues = kStepBlocks * kBlockValues;
#ifndef DFLASH_PREFETCH_ROWS
#define DFLASH_PREFETCH_ROWS 8
#endif
// Each step asks for the cache line this many weight rows further on: the rows of a tile are separate streams,
// more than the hardware prefetcher follows at once, and a one-row product waits on memory otherwise.
constexpr int64_t kPrefetchRows = DFLASH_PREFETCH_ROWS;
constexpr int64_t kStepLanes = kStepValues / kLaneValues;

// ---------------------------------------------------------------------------------------------------------
// Register tile: ROWS weight rows x INPUTS input rows, all of K.
// ---------------------------------------------------------------------------------------------------------
template <class Format, int ROWS, int INPUTS>
void tile(const uint8_t* weights, int64_t row_bytes, int64_t blocks, const QuantizedRows& x, int64_t first_input,
          float* y, int64_t n) {
  // weights: ROWS rows of row_bytes; y: INPUTS rows of n floats, column 0 = the first weight row
  Acc acc[ROWS][INPUTS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < INPUTS; ++c) acc[r][c] = acc_zero();
  }
  const int8_t* xq[INPUTS];
  const float* xs[INPUTS];
  const float* xm[INPUTS];
#pragma GCC unroll 16
  for (int c = 0; c < INPUTS; ++c) {
    xq[c] = x.values(first_input + c);
    xs[c] = x.scales(first_input + c);
    xm[c] = x.sums(first_input + c);
  }
  const auto step = [&](int64_t b, bool two) {
    typename Format::Chunk w[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t* block = weights + r * row_bytes + b * Format::kBytes;
      if constexpr (kPrefetchRows > 0) {  // past the matrix's end: a harmless hint
        _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchRows * row_bytes), _MM_HINT_T0);
      }
      w[r] = Format::load(block, two);
    }
    const int64_t value = b * kBlockValues, lane = value / kLaneValues;
#pragma GCC unroll 16
    for (int c = 0; c < INPUTS; ++c) {
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) Format::add(acc[r][c], w[r], xq[c] + value, xs[c] + lane, xm[c] + lane);
    }
  };
  int64_t b = 0;
  for (; b + kStepBlocks <= blocks; b += kStepBlocks) step(b, true);
  if (b < blocks) step(b, false);  // the last block of an odd count (512-bit steps); the pair's second half is zeros
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < INPUTS; ++c) y[c * n + r] = acc_reduce(acc[r][c]);
  }
}

// ROWS weight rows against `inputs` input rows: tiles of INPUTS input rows, then one smaller tile for the rest.
template <class Format, int ROWS, int INPUTS>
void rows_times_inputs(const uint8_t* weights, int64_t row_bytes, int64_t blocks, const QuantizedRows& x,
                       int64_t first_input, int64_t inputs, float* y, int64_t n) {
  int64_t c = 0;
  for (; c + INPUTS <= inputs; c += INPUTS) {
    tile<Format, ROWS, INPUTS>(weights, row_bytes, blocks, x, first_input + c, y + c * n, n);
  }
  if constexpr (INPUTS > 1) {
    if (c < inputs) {
      rows_times_inputs<Format, ROWS, INPUTS - 1>(weights, row_bytes, blocks, x, first_input + c, inputs - c,
                                                  y + c * n, n);
    }
  }
}

// Tile shapes; they change speed only, never results.
constexpr int SINGLE_ROWS = 4;       // one input row: weight rows per tile (independent accumulator chains)
constexpr int MULTI_ROWS = 2;        // several input rows: weight rows per tile
constexpr int MULTI_INPUTS = 6;      // several input rows: input rows per tile
constexpr int64_t INPUT_GROUP = 64;  // input rows that every weight row meets before the next group's turn

template <class Format>
void matmul_rows(const uint8_t* weights, int64_t row_bytes, int64_t blocks, const QuantizedRows& x, float* y,
                 int64_t n, int64_t row_begin, int64_t row_end) {
  const int64_t m = x.rows;
  int64_t row = row_begin;
  if (m == 1) {
    for (; row + SINGLE_ROWS <= row_end; row += SINGLE_ROWS) {
      tile<Format, SINGLE_ROWS, 1>(weights + row * row_bytes, row_bytes, blocks, x, 0, y + row, n);
    }
    for (; row < row_end; ++row) tile<Format, 1, 1>(weights + row * row_bytes, row_bytes, blocks, x, 0, y + row, n);
    return;
  }
  for (int64_t first = 0; first < m; first += INPUT_GROUP) {
    const int64_t inputs = std::min<int64_t>(INPUT_GROUP, m - first);
    float* out = y + first * n;
    row = row_begin;
    for (; row + MULTI_ROWS <= row_end; row += MULTI_ROWS) {
      rows_times_inputs<Format, MULTI_ROWS, MULTI_INPUTS>(weights + row * row_bytes, row_bytes, blocks, x, first,
                                                          inputs, out + row, n);
    }
    for (; row < row_end; ++row) {
      rows_times_inputs<Format, 1, MULTI_INPUTS>(weights + row * row_bytes, row_bytes, blocks, x, first, inputs,
                                                 out + row, n);
    }
  }
}

// Output rows handed to one task at least (so small matrices are not split into tiny pieces).
constexpr int64_t kMinRowsPerTask = 16;
#else
constexpr const char* kInt8Isa = "none";
#endif

}  // namespace

bool available() {
#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
  return true;
#else
  return false;
#endif
}

torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype) {
  // x: [M, K] float32; blocks: [N, K / 32 * block bytes] uint8 -> y: [M, N] float32
  TORCH_CHECK(available(), "int8 products need AVX2 (with FMA and F16C) or AVX-512 VNNI; this build has neither");
  const auto [input, out] = product_operands(x, blocks, qtype);
  const int64_t m = input.size(0), k = input.size(1), n = blocks.size(0);
  if (m == 0 || n == 0) return out;
#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
  const QuantizedRows rows = quantize_rows(input.data_ptr<float>(), m, k);
  const uint8_t* weights = blocks.data_ptr<uint8_t>();
  float* ys = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), n_blocks = k / kBlockValues;
  at::parallel_for(0, n, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    if (qtype == kTypeQ4_1) {
      matmul_rows<Q4_1Int8>(weights, row_bytes, n_blocks, rows, ys, n, begin, end);
    } else {
      matmul_rows<Q8_0Int8>(weights, row_bytes, n_blocks, rows, ys, n, begin, end);
    }
  });
#endif
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> quantize(const torch::Tensor& x) {
  // x: [M, K] float32 -> (q: [M, K] int8, scales: [M, K / 32] float32), as the products quantise their inputs
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) % kBlockValues == 0, "row length ", x.size(1), " is not a multiple of ", kBlockValues);
  const torch::Tensor input = x.contiguous();
  const int64_t m = input.size(0), k = input.size(1);
  const QuantizedRows rows = quantize_rows(input.data_ptr<float>(), m, k);
  torch::Tensor q = torch::empty({m, k}, torch::TensorOptions().dtype(torch::kInt8));
  torch::Tensor scales = torch::empty({m, k / kBlockValues}, torch::TensorOptions().dtype(torch::kFloat32));
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(q.data_ptr<int8_t>() + i * k, rows.values(i), static_cast<size_t>(k));
    std::memcpy(scales.data_ptr<float>() + i * (k / kBlockValues), rows.scale.data() + i * (rows.padded / kBlockValues),
                static_cast<size_t>(k / kBlockValues) * sizeof(float));
  }
  return {q, scales};
}

std::string isa() { return kInt8Isa; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.doc() = "Matrix products with GGUF Q4_1 / Q8_0 weights and int8-quantised inputs (integer dot products, "
                 "batch invariant)";
  module.def("matmul", &int8_matmul, "y[M, N] = int8(x)[M, K] @ dequant(blocks)[N, K]^T", py::arg("x"),
             py::arg("blocks"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  module.def("quantize", &quantize, "x [M, K] -> (int8 [M, K], scales [M, K / 32]) as the products quantise x",
             py::arg("x"), py::call_guard<py::gil_scoped_release>());
  module.def("available", &available, "whether this build has an integer dot product path");
  module.def("isa", &isa, "the instruction set this build uses: avx512-vnni, avx-vnni, avx2 or none");
}
