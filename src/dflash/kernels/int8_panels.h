// Weight panels: the int8 kernel's own layout of a Q4_0, Q4_1 or Q8_0 matrix (int8_matmul.cpp), for CPUs whose
// products run on the vector paths (AVX-512 VNNI; AVX2, with or without AVX-VNNI).
//
// In GGUF order each weight row is its own stream of blocks, so a vector lane holds 4 values of one row and the
// kernel must sum every row's lanes across the vector for each block (about 44 shuffles and adds per input row and
// block pair of 16 rows, more than the dot products themselves). A panel holds 16 weight rows interleaved instead:
// lane r of every 64-byte vector is 4 consecutive values of row r, so one vpdpbusd against an input's 4 values
// broadcast to every lane adds those 4 products into each row's own lane, and a block's integer dot product of
// every row is 8 vpdpbusd with nothing to sum across lanes. The integers and the float chain per output element
// are exactly those of int8_matmul.cpp's header, so a panel product is bitwise the row-stream product.
//
// Layout: [groups of 16 rows][blocks of 32 values] records, a group's records contiguous (one sequential stream
// per task). A record of block b of group g (rows 16 g .. 16 g + 15; rows past the matrix are zero bytes):
//   bytes 0..31    fp16 d of each row (lane order)
//   bytes 32..63   fp16 m of each row (Q4_1 only)
//   then the values, 64 bytes a vector, lane r = bytes 4 r .. 4 r + 3:
//     Q4_0, Q4_1 (4 vectors): vector j, byte t of lane r: value 8 j + t of row r in its low nibble and value
//                             8 j + 4 + t in its high nibble (so vector j's low nibbles are the input's dword 2 j,
//                             its high nibbles dword 2 j + 1)
//     Q8_0 (8 vectors):       vector j, byte t of lane r: value 4 j + t of row r plus 128, an unsigned byte
//                             (vpdpbusd's first operand is unsigned; the dot then carries 128 times the input
//                             block's integer sum, removed as Q4_0's 8 is)
// The same bytes as the GGUF rows (18, 20, 34 per row and block), only moved.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace {

constexpr int64_t kPanelRows = 16;

// Where a format's panel record keeps what, and how its values move from a GGUF block.
struct PanelFormat {
  int64_t source_bytes;  // one GGUF block of a row
  int64_t factor_bytes;  // the record's fp16 factors (d, and m for Q4_1)
  int64_t value_bytes;   // the record's value vectors
  bool nibbles;          // Q4_0, Q4_1: 4-bit values; Q8_0: bytes
  bool has_min;
  int64_t record_bytes() const { return factor_bytes + value_bytes; }
};

inline bool has_panels(int64_t qtype) { return qtype == kTypeQ4_0 || qtype == kTypeQ4_1 || qtype == kTypeQ8_0; }

inline PanelFormat panel_format(int64_t qtype) {
  if (qtype == kTypeQ4_0) return {18, 32, 256, true, false};
  if (qtype == kTypeQ4_1) return {20, 64, 256, true, true};
  if (qtype == kTypeQ8_0) return {34, 32, 512, false, false};
  TORCH_CHECK(false, "no panel layout for quantisation type ", qtype, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 have one)");
}

// Byte `offset` of the value vectors that holds value `i` (0..31) of lane `r`, and whether it is the high nibble.
inline int64_t panel_value_at(const PanelFormat& f, int64_t r, int64_t i, bool& high) {
  if (f.nibbles) {
    const int64_t j = i / 8, within = i % 8;
    high = within >= 4;
    return 64 * j + 4 * r + within % 4;
  }
  high = false;
  return 64 * (i / 4) + 4 * r + i % 4;
}

// One row's GGUF block -> its lane `r` of a panel record (the record's other lanes untouched).
inline void block_to_panel(const PanelFormat& f, const uint8_t* block, int64_t r, uint8_t* record) {
  std::memcpy(record + 2 * r, block, 2);                      // d
  if (f.has_min) std::memcpy(record + 32 + 2 * r, block + 2, 2);  // m
  uint8_t* values = record + f.factor_bytes;
  const uint8_t* q = block + (f.has_min ? 4 : 2);
  for (int64_t i = 0; i < kBlockValues; ++i) {
    bool high = false;
    const int64_t at = panel_value_at(f, r, i, high);
    if (f.nibbles) {
      const uint8_t value = i < 16 ? (q[i] & 0x0F) : (q[i - 16] >> 4);
      values[at] = static_cast<uint8_t>(high ? (values[at] & 0x0F) | (value << 4) : (values[at] & 0xF0) | value);
    } else {
      values[at] = static_cast<uint8_t>(q[i] ^ 0x80);
    }
  }
}

// Lane `r` of a panel record -> that row's GGUF block.
inline void panel_to_block(const PanelFormat& f, const uint8_t* record, int64_t r, uint8_t* block) {
  std::memcpy(block, record + 2 * r, 2);
  if (f.has_min) std::memcpy(block + 2, record + 32 + 2 * r, 2);
  uint8_t* q = block + (f.has_min ? 4 : 2);
  const uint8_t* values = record + f.factor_bytes;
  if (f.nibbles) std::memset(q, 0, 16);
  for (int64_t i = 0; i < kBlockValues; ++i) {
    bool high = false;
    const int64_t at = panel_value_at(f, r, i, high);
    if (f.nibbles) {
      const uint8_t value = high ? values[at] >> 4 : values[at] & 0x0F;
      q[i % 16] = static_cast<uint8_t>(q[i % 16] | (i < 16 ? value : value << 4));
    } else {
      q[i] = static_cast<uint8_t>(values[at] ^ 0x80);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// The products: 16 weight rows of a group (one lane each; two halves of 8 lanes on AVX2) x INPUTS input rows, one
// block a step.
// ---------------------------------------------------------------------------------------------------------
// The format traits `chain_step` reads (int8_matmul.cpp), per path: vpdpbusd multiplies Q8_0's stored unsigned
// bytes (value + 128) and removes 128 times the input's sum after, as Q4_0's 8; the AVX2 path turns them back into
// signed values and multiplies |w| by the input carrying w's sign (vpmaddubsw would saturate on value + 128), a
// dot product with no offset. Either way the same integer per block.
template <int64_t kQtype, bool kStoredQ8Offset>
struct PanelChain {
  static constexpr bool kHasMin = kQtype == kTypeQ4_1;
  static constexpr int kOffset = kQtype == kTypeQ4_0 ? 8 : (kQtype == kTypeQ8_0 && kStoredQ8Offset) ? 128 : 0;
  static constexpr bool kNibbles = kQtype != kTypeQ8_0;
  static constexpr int64_t kFactorBytes = kHasMin ? 64 : 32;
  static constexpr int64_t kRecordBytes = kFactorBytes + (kNibbles ? 256 : 512);
};

inline void input_words(const int8_t* input, int32_t (&words)[8]) { std::memcpy(words, input, sizeof words); }

#if defined(DFLASH_INT8_512)
constexpr int kPanelLanes = 16;  // lanes a vector holds: the whole group

// The 8 value vectors of a record as unsigned bytes, vector i against the input block's dword i.
template <class Chain>
inline void panel_values(const uint8_t* values, int /*half*/, __m512i (&w)[8]) {
  if constexpr (Chain::kNibbles) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(values + 64 * j);
      w[2 * j] = _mm512_and_si512(v, low_nibbles);
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
    }
  } else {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(values + 64 * j);
  }
}

// Every lane's integer dot product of a block: sum_i w[i] . broadcast(dword i of the input block), in two
// independent sums (integer additions: any order gives the same sums).
template <class Chain>
inline __m512i panel_dot(const __m512i (&w)[8], const int8_t* input) {
  int32_t words[8];
  input_words(input, words);
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) {
    even = _mm512_dpbusd_epi32(even, w[j], _mm512_set1_epi32(words[j]));
    odd = _mm512_dpbusd_epi32(odd, w[j + 1], _mm512_set1_epi32(words[j + 1]));
  }
  return _mm512_add_epi32(even, odd);
}

inline __m512 panel_factors(const uint8_t* at, int /*half*/) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}
inline void store_lanes(float* y, __m512 acc, int valid) {
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1u), acc);
}
using PanelVector = __m512i;
using PanelFloats = __m512;
inline __m512 zero_floats() { return _mm512_setzero_ps(); }
inline __m512i shifted_sum(__m512i high, __m512i low) { return _mm512_add_epi32(_mm512_slli_epi32(high, 8), low); }
constexpr bool kStoredQ8Offset = true;

#elif defined(DFLASH_INT8_256)
constexpr int kPanelLanes = 8;  // lanes a vector holds: half a group

// The 8 value vectors of a record's `half` (lanes 8 half .. 8 half + 7), vector i against the input's dword i:
// unsigned nibbles, or Q8_0's values back as signed bytes.
template <class Chain>
inline void panel_values(const uint8_t* values, int half, __m256i (&w)[8]) {
  if constexpr (Chain::kNibbles) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load_bytes(values + 64 * j + 32 * half);
      w[2 * j] = low_nibbles(v);
      w[2 * j + 1] = high_nibbles(v);
    }
  } else {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm256_xor_si256(load_bytes(values + 64 * j + 32 * half), _mm256_set1_epi8(static_cast<char>(0x80)));
    }
  }
}

template <class Chain>
inline __m256i panel_dot(const __m256i (&w)[8], const int8_t* input) {
  int32_t words[8];
  input_words(input, words);
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) {
    const __m256i x0 = _mm256_set1_epi32(words[j]), x1 = _mm256_set1_epi32(words[j + 1]);
    if constexpr (Chain::kNibbles) {
      even = _mm256_add_epi32(even, dot_u8_s8(w[j], x0));
      odd = _mm256_add_epi32(odd, dot_u8_s8(w[j + 1], x1));
    } else {  // |w| x (x with w's sign)
      even = _mm256_add_epi32(even, dot_u8_s8(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(x0, w[j])));
      odd = _mm256_add_epi32(odd, dot_u8_s8(_mm256_abs_epi8(w[j + 1]), _mm256_sign_epi8(x1, w[j + 1])));
    }
  }
  return _mm256_add_epi32(even, odd);
}

inline __m256 panel_factors(const uint8_t* at, int half) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16 * half)));
}
inline void store_lanes(float* y, __m256 acc, int valid) {
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  std::memcpy(y, out, static_cast<size_t>(valid) * sizeof(float));
}
using PanelVector = __m256i;
using PanelFloats = __m256;
inline __m256 zero_floats() { return _mm256_setzero_ps(); }
inline __m256i shifted_sum(__m256i high, __m256i low) { return _mm256_add_epi32(_mm256_slli_epi32(high, 8), low); }
constexpr bool kStoredQ8Offset = false;
#endif

#if defined(DFLASH_INT8_512) || defined(DFLASH_INT8_256)
// The `half`-th kPanelLanes lanes of a group (the group at `group`, `blocks` records) x INPUTS input rows from
// `first_input`, PARTS parts; y: INPUTS rows of n floats, this group's rows from `first_row`.
template <int64_t kQtype, int INPUTS, int PARTS>
void panel_tile(const uint8_t* group, int64_t blocks, int64_t n, int64_t first_row, int half, const QuantizedRows& x,
                int64_t first_input, float* y) {
  using Chain = PanelChain<kQtype, kStoredQ8Offset>;
  PanelFloats acc[INPUTS];
  for (int c = 0; c < INPUTS; ++c) acc[c] = zero_floats();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = group + b * Chain::kRecordBytes;
    _mm_prefetch(reinterpret_cast<const char*>(record + 16 * Chain::kRecordBytes), _MM_HINT_T0);
    const PanelFloats d = panel_factors(record, half);
    PanelFloats m = zero_floats();
    if constexpr (Chain::kHasMin) m = panel_factors(record + 32, half);
    PanelVector w[8];
    panel_values<Chain>(record + Chain::kFactorBytes, half, w);
#pragma GCC unroll 4
    for (int c = 0; c < INPUTS; ++c) {
      const int64_t input = first_input + c;
      PanelVector dots = panel_dot<Chain>(w, x.values(input) + b * kBlockValues);
      if constexpr (PARTS == 2) {  // 256 (w . q) + (w . low), as the row-stream path's dot2
        dots = shifted_sum(dots, panel_dot<Chain>(w, x.lows(input) + b * kBlockValues));
      }
      const int32_t* halves = x.half_totals(input) + 2 * b;
      acc[c] = chain_step<Chain>(acc[c], d, m, dots, x.scales(input)[b], x.sums(input)[b], halves[0] + halves[1]);
    }
  }
  const int64_t row = first_row + half * kPanelLanes;
  const int valid = static_cast<int>(std::min<int64_t>(kPanelLanes, n - row));
  for (int c = 0; c < INPUTS; ++c) store_lanes(y + c * n + row, acc[c], valid);
}

// Input rows per tile: each group's records are read once per tile (from L1 after the first tile).
constexpr int kPanelTileInputs = 4;

template <int64_t kQtype, int INPUTS, int PARTS>
void panel_times_inputs(const uint8_t* group, int64_t blocks, int64_t n, int64_t first_row, int half,
                        const QuantizedRows& x, int64_t first_input, int64_t inputs, float* y) {
  int64_t c = 0;
  for (; c + INPUTS <= inputs; c += INPUTS) {
    panel_tile<kQtype, INPUTS, PARTS>(group, blocks, n, first_row, half, x, first_input + c, y + c * n);
  }
  if constexpr (INPUTS > 1) {
    if (c < inputs) {
      panel_times_inputs<kQtype, INPUTS - 1, PARTS>(group, blocks, n, first_row, half, x, first_input + c,
                                                    inputs - c, y + c * n);
    }
  }
}

// Groups [group_begin, group_end) of a panel matrix against every input row.
template <int64_t kQtype, int PARTS>
void panel_groups(const uint8_t* panels, int64_t blocks, int64_t n, const QuantizedRows& x, float* y,
                  int64_t group_begin, int64_t group_end) {
  const int64_t group_bytes = blocks * PanelChain<kQtype, kStoredQ8Offset>::kRecordBytes;
  for (int64_t g = group_begin; g < group_end; ++g) {
    for (int half = 0; half * kPanelLanes < kPanelRows && g * kPanelRows + half * kPanelLanes < n; ++half) {
      panel_times_inputs<kQtype, kPanelTileInputs, PARTS>(panels + g * group_bytes, blocks, n, g * kPanelRows, half,
                                                          x, 0, x.rows, y);
    }
  }
}
#endif

}  // namespace
