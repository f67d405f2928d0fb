// GGUF quantised blocks shared by the CPU kernels: layouts, fp16 scales, dequantisation of Q4_1 and Q8_0 to
// float32 vectors per instruction set (AVX-512F, else AVX2 + FMA + F16C, else portable C++; chosen at compile time
// by -march=native), and the checks on a [rows, bytes] block tensor.
//
// Block layouts (little-endian). 32 weights each:
//   Q4_0, 18 bytes: fp16 d | 16 bytes; byte j holds weight j (low nibble) and j + 16 (high nibble);
//                   weight = d * (q - 8)
//   Q4_1, 20 bytes: fp16 d | fp16 m | 16 bytes of nibbles as Q4_0;       weight = d * q + m
//   Q8_0, 34 bytes: fp16 d | 32 int8 q;                                   weight = d * q
// Super-blocks of 256 weights (the K formats; read by int8_matmul.cpp only):
//   Q4_K, 144 bytes: fp16 d | fp16 dmin | 12 bytes of 6-bit scales sc_i and mins m_i of 8 sub-blocks of 32
//                    (their packing: int8_formats.h) | 128 bytes: bytes 32 p .. 32 p + 31 hold sub-block 2 p (low
//                    nibbles) and 2 p + 1 (high nibbles);               weight = d * sc_i * q - dmin * m_i
//   Q5_K, 176 bytes: as Q4_K with 32 bytes qh before the nibbles: bit i of qh[l] is the fifth bit (16) of value l
//                    of sub-block i;                                    weight = d * sc_i * q - dmin * m_i
//   Q6_K, 210 bytes: 128 bytes ql | 64 bytes qh | 16 int8 scales | fp16 d. The 32-value block c = 4 n + k
//                    (n = 0, 1; k = 0..3) takes its low 4 bits from ql[64 n + 32 (k % 2) + l] (low nibbles for
//                    k < 2, high ones after) and its top 2 bits from qh[32 n + l] >> 2 k; its two 16-value
//                    sub-blocks use scales 2 c and 2 c + 1;              weight = d * sc * (q - 32)
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "kernel_checks.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockValues = 32;
constexpr int64_t kTypeQ4_0 = 2;  // ggml type ids
constexpr int64_t kTypeQ4_1 = 3;
constexpr int64_t kTypeQ8_0 = 8;
constexpr int64_t kTypeQ4_K = 12;
constexpr int64_t kTypeQ5_K = 13;
constexpr int64_t kTypeQ6_K = 14;
constexpr int64_t kSuperBlockValues = 256;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // normal
  } else if (mantissa == 0) {
    bits = sign;  // zero
  } else {  // subnormal half: normalise
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Per-ISA primitives: Weights (32 dequantised weights), Accumulator (partial sums of one output element).
// ---------------------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";

struct Weights {
  __m512 lo, hi;  // weights 0..15, 16..31
};
struct Accumulator {
  __m512 lo, hi;
};

inline Weights dequant_q4_1(const uint8_t* block) {
  const __m512 d = _mm512_set1_ps(half_to_float(load_u16(block)));
  const __m512 m = _mm512_set1_ps(half_to_float(load_u16(block + 2)));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, nibble);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
  const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low));
  const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high));
  return {_mm512_add_ps(_mm512_mul_ps(d, q_lo), m), _mm512_add_ps(_mm512_mul_ps(d, q_hi), m)};
}

inline Weights dequant_q8_0(const uint8_t* block) {
  const __m512 d = _mm512_set1_ps(half_to_float(load_u16(block)));
  const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
  const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
  return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d)};
}

inline void zero(Accumulator& acc) {
  acc.lo = _mm512_setzero_ps();
  acc.hi = _mm512_setzero_ps();
}

inline void accumulate(Accumulator& acc, const Weights& w, const float* x) {
  acc.lo = _mm512_fmadd_ps(w.lo, _mm512_loadu_ps(x), acc.lo);
  acc.hi = _mm512_fmadd_ps(w.hi, _mm512_loadu_ps(x + 16), acc.hi);
}

inline float reduce(const Accumulator& acc) {
  const __m512 s16 = _mm512_add_ps(acc.lo, acc.hi);
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), upper);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline void store(const Weights& w, float* out) {
  _mm512_storeu_ps(out, w.lo);
  _mm512_storeu_ps(out + 16, w.hi);
}

// Parts: `accumulate` split into its lane groups (part 0: weights 0..15 -> lo, part 1: 16..31 -> hi), for
// weights already dequantised into memory. Same operations in the same order per accumulator.
constexpr int kParts = 2;
constexpr int kPartWidth = 16;
using Part = __m512;
inline Part load_part(const float* p) { return _mm512_loadu_ps(p); }
inline void accumulate_part(Accumulator& acc, int part, Part w, Part x) {
  if (part == 0) {
    acc.lo = _mm512_fmadd_ps(w, x, acc.lo);
  } else {
    acc.hi = _mm512_fmadd_ps(w, x, acc.hi);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";

struct Weights {
  __m256 v[4];  // weights 0..7, 8..15, 16..23, 24..31
};
struct Accumulator {
  __m256 even, odd;  // even: v[0] and v[2] terms, odd: v[1] and v[3] terms
};

inline Weights dequant_q4_1(const uint8_t* block) {
  const __m256 d = _mm256_set1_ps(half_to_float(load_u16(block)));
  const __m256 m = _mm256_set1_ps(half_to_float(load_u16(block + 2)));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, nibble);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  Weights w;
  for (int i = 0; i < 4; ++i) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
    w.v[i] = _mm256_add_ps(_mm256_mul_ps(d, q), m);
  }
  return w;
}

inline Weights dequant_q8_0(const uint8_t* block) {
  const __m256 d = _mm256_set1_ps(half_to_float(load_u16(block)));
  Weights w;
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
    w.v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
  }
  return w;
}

inline void zero(Accumulator& acc) {
  acc.even = _mm256_setzero_ps();
  acc.odd = _mm256_setzero_ps();
}

inline void accumulate(Accumulator& acc, const Weights& w, const float* x) {
  acc.even = _mm256_fmadd_ps(w.v[0], _mm256_loadu_ps(x), acc.even);
  acc.odd = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(x + 8), acc.odd);
  acc.even = _mm256_fmadd_ps(w.v[2], _mm256_loadu_ps(x + 16), acc.even);
  acc.odd = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(x + 24), acc.odd);
}

inline float reduce(const Accumulator& acc) {
  const __m256 s8 = _mm256_add_ps(acc.even, acc.odd);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline void store(const Weights& w, float* out) {
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, w.v[i]);
}

// Parts: `accumulate` split into its four lane groups (even parts -> acc.even, odd parts -> acc.odd), for
// weights already dequantised into memory. Same operations in the same order per accumulator.
constexpr int kParts = 4;
constexpr int kPartWidth = 8;
using Part = __m256;
inline Part load_part(const float* p) { return _mm256_loadu_ps(p); }
inline void accumulate_part(Accumulator& acc, int part, Part w, Part x) {
  if (part % 2 == 0) {
    acc.even = _mm256_fmadd_ps(w, x, acc.even);
  } else {
    acc.odd = _mm256_fmadd_ps(w, x, acc.odd);
  }
}

#else
constexpr const char* kIsa = "generic";

struct Weights {
  float v[kBlockValues];
};
struct Accumulator {
  float v[kBlockValues];  // one partial sum per lane
};

inline Weights dequant_q4_1(const uint8_t* block) {
  const float d = half_to_float(load_u16(block));
  const float m = half_to_float(load_u16(block + 2));
  Weights w;
  for (int j = 0; j < 16; ++j) {
    const uint8_t byte = block[4 + j];
    w.v[j] = d * static_cast<float>(byte & 0x0F) + m;
    w.v[j + 16] = d * static_cast<float>(byte >> 4) + m;
  }
  return w;
}

inline Weights dequant_q8_0(const uint8_t* block) {
  const float d = half_to_float(load_u16(block));
  Weights w;
  for (int j = 0; j < kBlockValues; ++j) {
    w.v[j] = static_cast<float>(static_cast<int8_t>(block[2 + j])) * d;
  }
  return w;
}

inline void zero(Accumulator& acc) {
  for (float& v : acc.v) v = 0.0f;
}

inline void accumulate(Accumulator& acc, const Weights& w, const float* x) {
  for (int j = 0; j < kBlockValues; ++j) acc.v[j] += w.v[j] * x[j];
}

inline float reduce(const Accumulator& acc) {
  float s[kBlockValues];
  std::memcpy(s, acc.v, sizeof s);
  for (int width = kBlockValues / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) s[j] += s[j + width];
  }
  return s[0];
}

inline void store(const Weights& w, float* out) { std::memcpy(out, w.v, sizeof w.v); }

// Parts: one part of all 32 lanes (the same operations as `accumulate`).
constexpr int kParts = 1;
constexpr int kPartWidth = kBlockValues;
struct Part {
  float v[kBlockValues];
};
inline Part load_part(const float* p) {
  Part part;
  std::memcpy(part.v, p, sizeof part.v);
  return part;
}
inline void accumulate_part(Accumulator& acc, int /*part*/, const Part& w, const Part& x) {
  for (int j = 0; j < kBlockValues; ++j) acc.v[j] += w.v[j] * x.v[j];
}
#endif

// ---------------------------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------------------------
struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static Weights dequant(const uint8_t* block) { return dequant_q4_1(block); }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static Weights dequant(const uint8_t* block) { return dequant_q8_0(block); }
};

// Values and bytes of one stored block.
struct BlockLayout {
  int64_t values, bytes;
};

// The formats of the float32 and bf16 kernels (quant_matmul.cpp, amx_matmul.cpp): Q4_1 and Q8_0.
int64_t block_bytes(int64_t qtype) {
  if (qtype == kTypeQ4_1) return Q4_1::kBytes;
  if (qtype == kTypeQ8_0) return Q8_0::kBytes;
  ::kernel_checks::refuse("unsupported quantisation type ", qtype, " (supported: Q4_1 = 3, Q8_0 = 8)");
}

// The formats of the int8 kernel (int8_matmul.cpp): Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.
BlockLayout int8_layout(int64_t qtype) {
  switch (qtype) {
    case kTypeQ4_0: return {kBlockValues, 18};
    case kTypeQ4_1: return {kBlockValues, Q4_1::kBytes};
    case kTypeQ8_0: return {kBlockValues, Q8_0::kBytes};
    case kTypeQ4_K: return {kSuperBlockValues, 144};
    case kTypeQ5_K: return {kSuperBlockValues, 176};
    case kTypeQ6_K: return {kSuperBlockValues, 210};
    default:
      ::kernel_checks::refuse("unsupported quantisation type ", qtype,
                  " (supported: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  }
}

void check_blocks(const torch::Tensor& blocks, BlockLayout layout, int64_t k) {
  DFLASH_CHECK(blocks.device().is_cpu(), "quantised blocks must be on the CPU");
  DFLASH_CHECK(blocks.scalar_type() == torch::kUInt8, "quantised blocks must be uint8");
  DFLASH_CHECK(blocks.dim() == 2 && blocks.is_contiguous(), "quantised blocks must be a contiguous [rows, bytes] tensor");
  DFLASH_CHECK(k % layout.values == 0, "row length ", k, " is not a multiple of ", layout.values);
  DFLASH_CHECK(blocks.size(1) == k / layout.values * layout.bytes, "blocks have ", blocks.size(1),
              " bytes per row, expected ", k / layout.values * layout.bytes, " for ", k, " values");
}

void check_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t k) {
  check_blocks(blocks, BlockLayout{kBlockValues, block_bytes(qtype)}, k);
}

// The checked, contiguous input x [M, K] of a product with `blocks` of `layout` and its float32 output y [M, N].
std::pair<torch::Tensor, torch::Tensor> product_operands(const torch::Tensor& x, const torch::Tensor& blocks,
                                                         BlockLayout layout) {
  DFLASH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  torch::Tensor input = x.contiguous();
  check_blocks(blocks, layout, input.size(1));
  torch::Tensor out = torch::empty({input.size(0), blocks.size(0)}, input.options());
  return {input, out};
}

std::pair<torch::Tensor, torch::Tensor> product_operands(const torch::Tensor& x, const torch::Tensor& blocks,
                                                         int64_t qtype) {
  return product_operands(x, blocks, BlockLayout{kBlockValues, block_bytes(qtype)});
}

}  // namespace
