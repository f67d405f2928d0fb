// The weight formats of the int8 kernel (int8_matmul.cpp), per instruction set: how a group of weight rows' blocks
// become bytes for integer dot products (unpacked in registers, never converted to floats), and the per-row float
// factors of each 32-value block that the kernel's float chain reads (int8_matmul.cpp's header gives the chain).
//
// A format trait says:
//   kBytes, kValues          bytes and values of one stored block (32, or 256 for the K formats' super-blocks)
//   kUnsigned                weights unpack to unsigned bytes (every format but Q8_0, whose int8 values are signed)
//   kOffset                  the integer the weights' bytes carry above their value (Q4_0: 8, Q6_K: 32); the chain
//                            subtracts kOffset * (the input block's integer sum) from each integer dot product
//   kHasMin                  a float min term per block (Q4_1: m; Q4_K, Q5_K: -dmin * m_i)
//   kHalves                  scales per 16-value half block (Q6_K): two chain steps per 32-value block
//   kOnTiles                 whether the AMX-INT8 tile path takes the format (Q6_K's half blocks do not fit its
//                            32-value tile products; it stays on the vector path, which gives the same bits)
// and per instruction set how to load the scales of a group of rows, how to unpack one row's values, and where
// the bytes of a block start (for prefetching).
//
// The K formats' 6-bit scales and mins (12 bytes at offset 4 of a Q4_K or Q5_K super-block, read as three 32-bit
// words w0, w1, w2 per row; byte j of a word below is sub-block j or 4 + j):
//   sc 0..3 = w0 & 0x3f3f3f3f                       m 0..3 = w1 & 0x3f3f3f3f
//   sc 4..7 = (w2 & 0x0f0f0f0f) | (((w0 >> 6) & 0x03030303) << 4)
//   m 4..7  = ((w2 >> 4) & 0x0f0f0f0f) | (((w1 >> 6) & 0x03030303) << 4)
// so one row is one lane of the word vectors, and every row of a group decodes at once. The factors d * sc and
// dmin * m are exact in float32 (an fp16 value times an integer below 2^8), so every path gets the same factors
// however it computes them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gguf_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH_INT8_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DFLASH_INT8_256 1
#endif

namespace {

constexpr int64_t kQ4_0Bytes = 18, kQ4_KBytes = 144, kQ5_KBytes = 176, kQ6_KBytes = 210;

// Where the bytes a step reads start in a row: block b's (32-value formats), or the part of b's super-block the
// pair or block at b reads (a cache line of it), so that prefetches run ahead over the whole super-block.
template <int64_t kBytes, int64_t kValues>
inline int64_t data_offset(int64_t b) {
  if constexpr (kValues == kBlockValues) {
    return b * kBytes;
  } else {
    return b / 8 * kBytes + std::min<int64_t>(32 * (b % 8), kBytes - 1);
  }
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: 16 weight rows (one per lane), a pair of 32-value blocks b, b + 1 (b even) per step.
// ---------------------------------------------------------------------------------------------------------
#if defined(DFLASH_INT8_512)
constexpr const char* kInt8Isa = "avx512-vnni";
constexpr int kGroupRows = 16;

// Per-lane (weight row) float factors of a pair of blocks: d[0], d[1] the blocks' scales (Q6_K: d[0..3], the
// scales of the pair's four 16-value halves in order), m[0], m[1] their min terms (formats with a min).
struct PairFactors {
  __m512 d[4];
  __m512 m[2];
};

// Four bytes at `at` of each row of the group (rows at rows[0] + offsets), one lane per row.
inline __m512i gather_words(const uint8_t* row0, __m512i offsets, int64_t at) {
  return _mm512_i32gather_epi32(offsets, row0 + at, 1);
}
inline __m512 low_half(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
inline __m512 high_half(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }
inline __m512 byte_of(__m512i words, int j) {  // unsigned byte j of each lane
  return _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_srlv_epi32(words, _mm512_set1_epi32(8 * j)), _mm512_set1_epi32(0xFF)));
}
inline __m512 signed_byte_of(__m512i words, int j) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sllv_epi32(words, _mm512_set1_epi32(24 - 8 * j)), 24));
}
inline __m512 negated(__m512 v) {  // exact: the sign bit flipped
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

// 32 bytes -> 64 values: their low nibbles, then their high nibbles.
inline __m512i nibble_halves(const uint8_t* bytes) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
  return _mm512_and_si512(_mm512_srlv_epi64(both, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4)), _mm512_set1_epi8(0x0F));
}

// Two bits of each of 32 bytes, shifted right by `first` for the first 32 values and by `second` for the next 32.
inline __m512i bits_of(const uint8_t* bytes, int first, int second, int mask) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
  const __m512i shifts = _mm512_setr_epi64(first, first, first, first, second, second, second, second);
  return _mm512_and_si512(_mm512_srlv_epi64(both, shifts), _mm512_set1_epi8(static_cast<char>(mask)));
}

// Unsigned weight bytes against signed inputs (vpdpbusd).
struct UnsignedDots {
  static constexpr bool kUnsigned = true;
  static inline __m512i input(__m512i q) { return q; }
  static inline __m512i dot(__m512i w, __m512i x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x); }
  // 256 (w . high) + (w . low), per lane
  static inline __m512i dot2(__m512i w, __m512i high, __m512i low) {
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(dot(w, high), 8), w, low);
  }
};

// 32-value formats: scales gathered per pair (the block's first 4 bytes: d, and m for Q4_1).
template <int64_t kBlockBytes, int kNibblesAt>
struct NibblePairs : UnsignedDots {
  static constexpr int64_t kBytes = kBlockBytes, kValues = kBlockValues;
  static constexpr int kPairsPerLoad = 1;
  static constexpr bool kHalves = false, kOnTiles = true;
  using Loaded = PairFactors;
  static inline const PairFactors& pair(const Loaded& loaded, int /*pair*/) { return loaded; }
  // 64 nibbles as bytes (block b's 32 values, then block b + 1's; zeros for a missing second block)
  static inline __m512i unpack(const uint8_t* row, int64_t b, bool two) {
    const uint8_t* block = row + b * kBytes;
    const __m128i n0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibblesAt));
    const __m128i n1 =
        two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kBytes + kNibblesAt)) : _mm_setzero_si128();
    const __m512i both = _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(n0), n1, 1));
    // 128-bit lanes [n0, n0, n1, n1]; the second copy of each shifted down by a nibble
    const __m512i spread = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), both);
    const __m512i shifted = _mm512_srlv_epi64(spread, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
  }
};

struct Q4_1Int8 : NibblePairs<Q4_1::kBytes, 4> {
  static constexpr bool kHasMin = true;
  static constexpr int kOffset = 0;
  static inline Loaded load(const uint8_t* row0, __m512i offsets, int64_t b, bool two) {
    const __m512i first = gather_words(row0, offsets, b * kBytes);
    const __m512i second = two ? gather_words(row0, offsets, (b + 1) * kBytes) : _mm512_setzero_si512();
    Loaded f;
    f.d[0] = low_half(first), f.d[1] = low_half(second), f.m[0] = high_half(first), f.m[1] = high_half(second);
    f.d[2] = f.d[3] = _mm512_setzero_ps();
    return f;
  }
};

struct Q4_0Int8 : NibblePairs<kQ4_0Bytes, 2> {
  static constexpr bool kHasMin = false;
  static constexpr int kOffset = 8;
  static inline Loaded load(const uint8_t* row0, __m512i offsets, int64_t b, bool two) {
    Loaded f;
    f.d[0] = low_half(gather_words(row0, offsets, b * kBytes));
    f.d[1] = two ? low_half(gather_words(row0, offsets, (b + 1) * kBytes)) : _mm512_setzero_ps();
    f.d[2] = f.d[3] = f.m[0] = f.m[1] = _mm512_setzero_ps();
    return f;
  }
};

struct Q8_0Int8 {
  static constexpr int64_t kBytes = Q8_0::kBytes, kValues = kBlockValues;
  static constexpr int kPairsPerLoad = 1, kOffset = 0;
  static constexpr bool kHasMin = false, kUnsigned = false, kHalves = false, kOnTiles = true;
  using Loaded = PairFactors;
  static inline Loaded load(const uint8_t* row0, __m512i offsets, int64_t b, bool two) {
    Loaded f;
    f.d[0] = low_half(gather_words(row0, offsets, b * kBytes));
    f.d[1] = two ? low_half(gather_words(row0, offsets, (b + 1) * kBytes)) : _mm512_setzero_ps();
    f.d[2] = f.d[3] = f.m[0] = f.m[1] = _mm512_setzero_ps();
    return f;
  }
  static inline const PairFactors& pair(const Loaded& loaded, int /*pair*/) { return loaded; }
  static inline __m512i unpack(const uint8_t* row, int64_t b, bool two) {
    const uint8_t* block = row + b * kBytes;
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    const __m256i q1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kBytes + 2))
                           : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
  }
  // q + 128 as unsigned bytes: vpdpbusd multiplies unsigned by signed, and both of Q8_0's sides are signed
  static inline __m512i input(__m512i q) { return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80))); }
  // sum (q + 128) w - 128 sum w = sum q w, per lane
  static inline __m512i dot(__m512i w, __m512i x) {
    const __m512i offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), w);
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w), offset);
  }
  // 256 (high . w) + (low . w) from the offset inputs: 256 sum (h + 128) w + sum (l + 128) w - 257 * 128 sum w
  static inline __m512i dot2(__m512i w, __m512i high, __m512i low) {
    const __m512i offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), w);
    const __m512i both =
        _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), high, w), 8), low, w);
    return _mm512_sub_epi32(both, _mm512_add_epi32(_mm512_slli_epi32(offset, 8), offset));
  }
};

// Q4_K and Q5_K: a super-block's d, dmin and 6-bit scales and mins for every row of the group (one lane per row);
// sc[0] / m[0] hold sub-blocks 0..3 as bytes, sc[1] / m[1] sub-blocks 4..7.
struct KScales {
  __m512 d, dmin;
  __m512i sc[2], m[2];
};

inline KScales k_scales(const uint8_t* row0, __m512i offsets, int64_t at) {
  const __m512i dd = gather_words(row0, offsets, at);
  const __m512i w0 = gather_words(row0, offsets, at + 4), w1 = gather_words(row0, offsets, at + 8),
                w2 = gather_words(row0, offsets, at + 12);
  const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f),
                top = _mm512_set1_epi32(0x03030303);
  KScales s;
  s.d = low_half(dd);
  s.dmin = high_half(dd);
  s.sc[0] = _mm512_and_si512(w0, six);
  s.m[0] = _mm512_and_si512(w1, six);
  s.sc[1] = _mm512_or_si512(_mm512_and_si512(w2, four),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), top), 4));
  s.m[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), four),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), top), 4));
  return s;
}

// Sub-blocks 2 p and 2 p + 1: d * sc and -(dmin * m).
inline PairFactors k_pair(const KScales& s, int p) {
  const __m512i sc = s.sc[p / 2], m = s.m[p / 2];
  const int j = 2 * (p % 2);
  PairFactors f;
  f.d[0] = _mm512_mul_ps(s.d, byte_of(sc, j));
  f.d[1] = _mm512_mul_ps(s.d, byte_of(sc, j + 1));
  f.m[0] = negated(_mm512_mul_ps(s.dmin, byte_of(m, j)));
  f.m[1] = negated(_mm512_mul_ps(s.dmin, byte_of(m, j + 1)));
  f.d[2] = f.d[3] = _mm512_setzero_ps();
  return f;
}

template <int64_t kSuperBytes>
struct KPairs : UnsignedDots {
  static constexpr int64_t kBytes = kSuperBytes, kValues = kSuperBlockValues;
  static constexpr int kPairsPerLoad = 4, kOffset = 0;
  static constexpr bool kHasMin = true, kHalves = false, kOnTiles = true;
  using Loaded = KScales;
  static inline Loaded load(const uint8_t* row0, __m512i offsets, int64_t b, bool /*two*/) {
    return k_scales(row0, offsets, b / 8 * kBytes);
  }
  static inline PairFactors pair(const Loaded& loaded, int p) { return k_pair(loaded, p); }
};

struct Q4_KInt8 : KPairs<kQ4_KBytes> {
  static inline __m512i unpack(const uint8_t* row, int64_t b, bool /*two*/) {
    return nibble_halves(row + b / 8 * kBytes + 16 + 32 * (b % 8 / 2));
  }
};

struct Q5_KInt8 : KPairs<kQ5_KBytes> {
  static inline __m512i unpack(const uint8_t* row, int64_t b, bool /*two*/) {
    const uint8_t* super = row + b / 8 * kBytes;
    const int p = static_cast<int>(b % 8 / 2);
    const __m512i fifth = bits_of(super + 16, 2 * p, 2 * p + 1, 0x01);  // bits 2 p, 2 p + 1 of qh
    return _mm512_or_si512(nibble_halves(super + 48 + 32 * p), _mm512_slli_epi16(fifth, 4));
  }
};

// Q6_K: d and the 16 int8 scales (four words, lane = row) of a super-block.
struct Q6Scales {
  __m512 d;
  __m512i words[4];
};

struct Q6_KInt8 : UnsignedDots {
  static constexpr int64_t kBytes = kQ6_KBytes, kValues = kSuperBlockValues;
  static constexpr int kPairsPerLoad = 4, kOffset = 32;
  static constexpr bool kHasMin = false, kHalves = true, kOnTiles = false;
  using Loaded = Q6Scales;
  static inline Loaded load(const uint8_t* row0, __m512i offsets, int64_t b, bool /*two*/) {
    const int64_t at = b / 8 * kBytes;
    Loaded s;
    s.d = high_half(gather_words(row0, offsets, at + 206));  // bytes 206..209: the last two scales, then d
    for (int w = 0; w < 4; ++w) s.words[w] = gather_words(row0, offsets, at + 192 + 4 * w);
    return s;
  }
  // the pair p's halves: scales 4 p .. 4 p + 3
  static inline PairFactors pair(const Loaded& s, int p) {
    PairFactors f;
    for (int h = 0; h < 4; ++h) f.d[h] = _mm512_mul_ps(s.d, signed_byte_of(s.words[p], h));
    f.m[0] = f.m[1] = _mm512_setzero_ps();
    return f;
  }
  static inline __m512i unpack(const uint8_t* row, int64_t b, bool /*two*/) {
    const uint8_t* super = row + b / 8 * kBytes;
    const int p = static_cast<int>(b % 8 / 2), n = p / 2, odd = p % 2;
    const __m512i ql = _mm512_loadu_si512(super + 64 * n);
    const __m512i low = _mm512_and_si512(odd ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    const __m512i top = bits_of(super + 128 + 32 * n, 4 * odd, 4 * odd + 2, 0x03);
    return _mm512_or_si512(low, _mm512_slli_epi16(top, 4));
  }
};

// ---------------------------------------------------------------------------------------------------------
// AVX2 (+ AVX-VNNI): 8 weight rows (one per lane), one 32-value block per step.
// ---------------------------------------------------------------------------------------------------------
#elif defined(DFLASH_INT8_256)
#if defined(__AVXVNNI__)
constexpr const char* kInt8Isa = "avx-vnni";
inline __m256i dot_u8_s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#else
constexpr const char* kInt8Isa = "avx2";
// |u * s| <= 128 * 127 per byte pair here (weights below 64, or |qw| <= 128 against |qx| <= 127): a pair's sum
// stays below 2^15, so vpmaddubsw never saturates
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif
constexpr int kGroupRows = 8;

// Per-lane (weight row) float factors of one block: d[0] its scale (Q6_K: d[0], d[1] those of its two halves),
// m its min term (formats with a min).
struct BlockFactors {
  __m256 d[2];
  __m256 m;
};

inline __m256i gather_words(const uint8_t* row0, __m256i offsets, int64_t at) {
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(row0 + at), offsets, 1);
}
inline __m256 low_half(__m256i v) {
  const __m256i halves = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_setzero_si256());
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08)));  // lanes 0..3, 4..7
}
inline __m256 high_half(__m256i v) { return low_half(_mm256_srli_epi32(v, 16)); }
inline __m256 byte_of(__m256i words, int j) {
  return _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_set1_epi32(8 * j)), _mm256_set1_epi32(0xFF)));
}
inline __m256 signed_byte_of(__m256i words, int j) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(words, _mm256_set1_epi32(24 - 8 * j)), 24));
}
// Each 16-bit lane shifted right by a count known at run time only.
inline __m256i shifted_right(__m256i v, int count) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(count)); }
inline __m256 negated(__m256 v) { return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }

inline __m256i load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

struct UnsignedDots {
  static constexpr bool kUnsigned = true;
  struct Unpacked {
    __m256i w;  // 32 unsigned values as bytes
  };
  static inline __m256i dot(const Unpacked& w, __m256i x) { return dot_u8_s8(w.w, x); }
};

// 32-value formats: d (and m) read per row and block.
template <int64_t kBlockBytes, int kNibblesAt, bool kMin>
struct NibbleBlocks : UnsignedDots {
  static constexpr int64_t kBytes = kBlockBytes, kValues = kBlockValues;
  static constexpr int kBlocksPerLoad = 1;
  using Loaded = BlockFactors;
  static inline Loaded load(const uint8_t* const (&rows)[kGroupRows], __m256i /*offsets*/, int64_t b) {
    alignas(32) float ds[kGroupRows], ms[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      const uint8_t* block = rows[r] + b * kBytes;
      ds[r] = half_to_float(load_u16(block));
      ms[r] = kMin ? half_to_float(load_u16(block + 2)) : 0.0f;
    }
    return {{_mm256_load_ps(ds), _mm256_setzero_ps()}, _mm256_load_ps(ms)};
  }
  static inline const BlockFactors& block(const Loaded& loaded, int /*c*/) { return loaded; }
  static inline Unpacked unpack(const uint8_t* row, int64_t b) {
    const uint8_t* block = row + b * kBytes;
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibblesAt));
    const __m256i spread = _mm256_broadcastsi128_si256(packed);
    const __m256i shifted = _mm256_srlv_epi64(spread, _mm256_setr_epi64x(0, 0, 4, 4));
    return {_mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))};
  }
};

struct Q4_1Int8 : NibbleBlocks<Q4_1::kBytes, 4, true> {
  static constexpr bool kHasMin = true, kHalves = false;
  static constexpr int kOffset = 0;
};

struct Q4_0Int8 : NibbleBlocks<kQ4_0Bytes, 2, false> {
  static constexpr bool kHasMin = false, kHalves = false;
  static constexpr int kOffset = 8;
};

struct Q8_0Int8 {
  static constexpr int64_t kBytes = Q8_0::kBytes, kValues = kBlockValues;
  static constexpr int kBlocksPerLoad = 1, kOffset = 0;
  static constexpr bool kHasMin = false, kUnsigned = false, kHalves = false;
  using Loaded = BlockFactors;
  struct Unpacked {
    __m256i q, magnitude;  // qw, |qw| (unsigned)
  };
  static inline Loaded load(const uint8_t* const (&rows)[kGroupRows], __m256i /*offsets*/, int64_t b) {
    alignas(32) float ds[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) ds[r] = half_to_float(load_u16(rows[r] + b * kBytes));
    return {{_mm256_load_ps(ds), _mm256_setzero_ps()}, _mm256_setzero_ps()};
  }
  static inline const BlockFactors& block(const Loaded& loaded, int /*c*/) { return loaded; }
  static inline Unpacked unpack(const uint8_t* row, int64_t b) {
    const __m256i q = load_bytes(row + b * kBytes + 2);
    return {q, _mm256_abs_epi8(q)};
  }
  // |qw| x (qx with qw's sign)
  static inline __m256i dot(const Unpacked& w, __m256i x) { return dot_u8_s8(w.magnitude, _mm256_sign_epi8(x, w.q)); }
};

struct KScales {
  __m256 d, dmin;
  __m256i sc[2], m[2];
};

template <int64_t kSuperBytes>
struct KBlocks : UnsignedDots {
  static constexpr int64_t kBytes = kSuperBytes, kValues = kSuperBlockValues;
  static constexpr int kBlocksPerLoad = 8, kOffset = 0;
  static constexpr bool kHasMin = true, kHalves = false;
  using Loaded = KScales;
  static inline Loaded load(const uint8_t* const (&rows)[kGroupRows], __m256i offsets, int64_t b) {
    const int64_t at = b / 8 * kBytes;
    const __m256i dd = gather_words(rows[0], offsets, at);
    const __m256i w0 = gather_words(rows[0], offsets, at + 4), w1 = gather_words(rows[0], offsets, at + 8),
                  w2 = gather_words(rows[0], offsets, at + 12);
    const __m256i six = _mm256_set1_epi32(0x3f3f3f3f), four = _mm256_set1_epi32(0x0f0f0f0f),
                  top = _mm256_set1_epi32(0x03030303);
    KScales s;
    s.d = low_half(dd);
    s.dmin = high_half(dd);
    s.sc[0] = _mm256_and_si256(w0, six);
    s.m[0] = _mm256_and_si256(w1, six);
    s.sc[1] = _mm256_or_si256(_mm256_and_si256(w2, four),
                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), top), 4));
    s.m[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), four),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), top), 4));
    return s;
  }
  // sub-block c: d * sc and -(dmin * m)
  static inline BlockFactors block(const Loaded& s, int c) {
    return {{_mm256_mul_ps(s.d, byte_of(s.sc[c / 4], c % 4)), _mm256_setzero_ps()},
            negated(_mm256_mul_ps(s.dmin, byte_of(s.m[c / 4], c % 4)))};
  }
};

struct Q4_KInt8 : KBlocks<kQ4_KBytes> {
  static inline Unpacked unpack(const uint8_t* row, int64_t b) {
    const __m256i bytes = load_bytes(row + b / 8 * kBytes + 16 + 32 * (b % 8 / 2));
    return {b % 2 ? high_nibbles(bytes) : low_nibbles(bytes)};
  }
};

struct Q5_KInt8 : KBlocks<kQ5_KBytes> {
  static inline Unpacked unpack(const uint8_t* row, int64_t b) {
    const uint8_t* super = row + b / 8 * kBytes;
    const int c = static_cast<int>(b % 8);
    const __m256i bytes = load_bytes(super + 48 + 32 * (c / 2));
    const __m256i fifth = _mm256_and_si256(shifted_right(load_bytes(super + 16), c), _mm256_set1_epi8(0x01));
    return {_mm256_or_si256(c % 2 ? high_nibbles(bytes) : low_nibbles(bytes), _mm256_slli_epi16(fifth, 4))};
  }
};

struct Q6Scales {
  __m256 d;
  __m256i words[4];
};

struct Q6_KInt8 : UnsignedDots {
  static constexpr int64_t kBytes = kQ6_KBytes, kValues = kSuperBlockValues;
  static constexpr int kBlocksPerLoad = 8, kOffset = 32;
  static constexpr bool kHasMin = false, kHalves = true;
  using Loaded = Q6Scales;
  static inline Loaded load(const uint8_t* const (&rows)[kGroupRows], __m256i offsets, int64_t b) {
    const int64_t at = b / 8 * kBytes;
    Q6Scales s;
    s.d = high_half(gather_words(rows[0], offsets, at + 206));  // bytes 206..209: the last two scales, then d
    for (int w = 0; w < 4; ++w) s.words[w] = gather_words(rows[0], offsets, at + 192 + 4 * w);
    return s;
  }
  // block c's halves: scales 2 c and 2 c + 1
  static inline BlockFactors block(const Loaded& s, int c) {
    const __m256i word = s.words[c / 2];
    return {{_mm256_mul_ps(s.d, signed_byte_of(word, 2 * (c % 2))),
             _mm256_mul_ps(s.d, signed_byte_of(word, 2 * (c % 2) + 1))},
            _mm256_setzero_ps()};
  }
  static inline Unpacked unpack(const uint8_t* row, int64_t b) {
    const uint8_t* super = row + b / 8 * kBytes;
    const int c = static_cast<int>(b % 8), n = c / 4, k = c % 4;
    const __m256i ql = load_bytes(super + 64 * n + 32 * (k % 2));
    const __m256i top = _mm256_and_si256(shifted_right(load_bytes(super + 128 + 32 * n), 2 * k),
                                         _mm256_set1_epi8(0x03));
    return {_mm256_or_si256(k >= 2 ? high_nibbles(ql) : low_nibbles(ql), _mm256_slli_epi16(top, 4))};
  }
};
#endif

}  // namespace
