// Weight panels: the int8 kernel's own layout of a Q4_0, Q4_1 or Q8_0 matrix (int8_matmul.cpp), for CPUs whose
// products run on the AVX-512 VNNI vector path.
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
#include "kernel_checks.h"

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

inline PanelFormat panel_format(int64_t qtype) {
  if (qtype == kTypeQ4_0) return {18, 32, 256, true, false};
  if (qtype == kTypeQ4_1) return {20, 64, 256, true, true};
  if (qtype == kTypeQ8_0) return {34, 32, 512, false, false};
  ::kernel_checks::refuse("no panel layout for quantisation type ", qtype, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 have one)");
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
// The products (AVX-512 VNNI): 16 weight rows of a group (one lane each) x INPUTS input rows, one block a step.
// On the 256-bit paths a row's block is one vector, summed across its lanes in a few instructions: panels gained
// nothing there (0.9-1.1x, measured with the same code on 8-lane halves) and those builds keep GGUF rows.
// ---------------------------------------------------------------------------------------------------------
#if defined(DFLASH_INT8_512)
// The 8 value vectors of a record as unsigned bytes, vector i against the input block's dword i.
template <bool kNibbles>
inline void panel_values(const uint8_t* values, __m512i (&w)[8]) {
  if constexpr (kNibbles) {
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
inline __m512i panel_dot(const __m512i (&w)[8], const int8_t* input) {
  int32_t words[8];
  std::memcpy(words, input, sizeof words);
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) {
    even = _mm512_dpbusd_epi32(even, w[j], _mm512_set1_epi32(words[j]));
    odd = _mm512_dpbusd_epi32(odd, w[j + 1], _mm512_set1_epi32(words[j + 1]));
  }
  return _mm512_add_epi32(even, odd);
}

// The format traits `chain_step` reads (int8_matmul.cpp): vpdpbusd multiplies Q8_0's stored unsigned bytes (value +
// 128), and 128 times the input's sum is removed after, as Q4_0's 8.
template <int64_t kQtype>
struct PanelChain {
  static constexpr bool kHasMin = kQtype == kTypeQ4_1;
  static constexpr int kOffset = kQtype == kTypeQ4_0 ? 8 : kQtype == kTypeQ8_0 ? 128 : 0;
  static constexpr bool kNibbles = kQtype != kTypeQ8_0;
  static constexpr int64_t kFactorBytes = kHasMin ? 64 : 32;
  static constexpr int64_t kRecordBytes = kFactorBytes + (kNibbles ? 256 : 512);
};

// 16 weight rows (the group at `group`, `blocks` records) x INPUTS input rows from `first_input`, PARTS parts;
// y: INPUTS rows of n floats, this group's lanes from `first_row`.
template <int64_t kQtype, int INPUTS, int PARTS>
void panel_tile(const uint8_t* group, int64_t blocks, int64_t n, int64_t first_row, const QuantizedRows& x,
                int64_t first_input, float* y) {
  using Chain = PanelChain<kQtype>;
  __m512 acc[INPUTS];
  for (int c = 0; c < INPUTS; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = group + b * Chain::kRecordBytes;
    _mm_prefetch(reinterpret_cast<const char*>(record + 16 * Chain::kRecordBytes), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (Chain::kHasMin) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 32)));
    __m512i w[8];
    panel_values<Chain::kNibbles>(record + Chain::kFactorBytes, w);
#pragma GCC unroll 4
    for (int c = 0; c < INPUTS; ++c) {
      const int64_t input = first_input + c;
      __m512i dots = panel_dot(w, x.values(input) + b * kBlockValues);
      if constexpr (PARTS == 2) {  // 256 (w . q) + (w . low), as the row-stream path's dot2
        dots = _mm512_add_epi32(_mm512_slli_epi32(dots, 8), panel_dot(w, x.lows(input) + b * kBlockValues));
      }
      const int32_t* halves = x.half_totals(input) + 2 * b;
      acc[c] = chain_step<Chain>(acc[c], d, m, dots, x.scales(input)[b], x.sums(input)[b], halves[0] + halves[1]);
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(kPanelRows, n - first_row));
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  for (int c = 0; c < INPUTS; ++c) _mm512_mask_storeu_ps(y + c * n + first_row, mask, acc[c]);
}

// Input rows per tile: each group's records are read once per tile (from L1 after the first tile).
constexpr int kPanelTileInputs = 4;

template <int64_t kQtype, int INPUTS, int PARTS>
void panel_times_inputs(const uint8_t* group, int64_t blocks, int64_t n, int64_t first_row, const QuantizedRows& x,
                        int64_t first_input, int64_t inputs, float* y) {
  int64_t c = 0;
  for (; c + INPUTS <= inputs; c += INPUTS) {
    panel_tile<kQtype, INPUTS, PARTS>(group, blocks, n, first_row, x, first_input + c, y + c * n);
  }
  if constexpr (INPUTS > 1) {
    if (c < inputs) {
      panel_times_inputs<kQtype, INPUTS - 1, PARTS>(group, blocks, n, first_row, x, first_input + c, inputs - c,
                                                    y + c * n);
    }
  }
}

// Groups [group_begin, group_end) of a panel matrix against every input row.
template <int64_t kQtype, int PARTS>
void panel_groups(const uint8_t* panels, int64_t blocks, int64_t n, const QuantizedRows& x, float* y,
                  int64_t group_begin, int64_t group_end) {
  const int64_t group_bytes = blocks * PanelChain<kQtype>::kRecordBytes;
  for (int64_t g = group_begin; g < group_end; ++g) {
    panel_times_inputs<kQtype, kPanelTileInputs, PARTS>(panels + g * group_bytes, blocks, n, g * kPanelRows, x, 0,
                                                        x.rows, y);
  }
}
#endif

}  // namespace
