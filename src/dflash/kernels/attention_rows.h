// One query row's attention over a KV cache with AVX-512, for head sizes of 64 and 128 (cpu_layer_ops.cpp).
//
// The layer kernel's portable path spends most of a verification's attention in per-key horizontal sums and
// scalar softmax loops. Here sixteen keys' dot products are formed at once and summed lane-wise in one fixed tree,
// the softmax runs sixteen keys per instruction and the value sums use fused multiply-adds.
//
// Row invariance holds as in the rest of the kernel, and it decides the order of every sum:
//  * a key's score depends on the query and that key alone (its own accumulator, the same tree for every key);
//  * the maximum is exact in any order; exp is elementwise;
//  * the weighted values and the weights' total must not depend on where the masked keys sit (a verified tree row
//    sees its ancestors at scattered slots, the same row decoded alone sees them side by side): they are one
//    sequential sum over the keys in order, to which a masked key (weight exactly zero) adds exactly nothing.
//
// Keys and values are read through an addressing functor, row l -> pointer to its head_dim floats: a cache's
// positions side by side (StridedRows) or a request's positions scattered over a paged pool (SlotRows). Only the
// addresses differ, never the arithmetic, so a request read through its slots is bitwise the same request read
// from a gathered copy. The functors also serve the portable path, hence outside the AVX-512 block.
#pragma once

#include <cstdint>

namespace attention_rows {

// Row l at base + l * stride.
struct StridedRows {
  const float* base;
  int64_t stride;
  const float* operator()(int64_t l) const { return base + l * stride; }
};

// Row l at base + slots[l] * stride (slots checked in range by the caller).
struct SlotRows {
  const float* base;
  int64_t stride;
  const int64_t* slots;
  const float* operator()(int64_t l) const { return base + slots[l] * stride; }
};

}  // namespace attention_rows

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <limits>

namespace attention_rows {

// How far ahead the next rows are asked for: keys or values may sit anywhere (a paged pool's blocks), where the
// hardware's stream prefetch stops at each jump. Only loads are added; the arithmetic is untouched.
constexpr int64_t kKeyAhead = 16, kValueAhead = 8;

// Sixteen keys' dot products with one query of 16 * kChunks floats -> [16] in key order. Key i's lane j sums
// q[j + 16c] * k_i[j + 16c] over c in order; the 16 lanes are then added pairwise (j with j + 8, then + 4, + 2,
// + 1), the same tree for every key.
template <int kChunks>
inline __m512 dot16(const __m512* query, const float* const* key) {
  __m512 lanes[16];
  for (int i = 0; i < 16; ++i) {
    __m512 sum = _mm512_mul_ps(query[0], _mm512_loadu_ps(key[i]));
    for (int c = 1; c < kChunks; ++c) sum = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(key[i] + 16 * c), sum);
    lanes[i] = sum;
  }
  __m512 halves[8];  // [i]: key i's 8 sums (j, j + 8) in the low 256 bits, key i + 8's in the high ones
  for (int i = 0; i < 8; ++i) {
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(lanes[i], lanes[i + 8], 0x44),
                              _mm512_shuffle_f32x4(lanes[i], lanes[i + 8], 0xEE));
  }
  __m512 quarters[4];  // [i]: 4 sums per 128-bit lane for keys i, i + 8, i + 4, i + 12
  for (int i = 0; i < 4; ++i) {
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[i], halves[i + 4], 0x88),
                                _mm512_shuffle_f32x4(halves[i], halves[i + 4], 0xDD));
  }
  __m512 pairs[2];  // [i]: per 128-bit lane, 2 sums of quarters[i]'s key, then 2 of quarters[i + 2]'s
  for (int i = 0; i < 2; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[i], quarters[i + 2], 0x44),
                             _mm512_shuffle_ps(quarters[i], quarters[i + 2], 0xEE));
  }
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  // sums holds keys 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15
  const __m512i key_order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(key_order, sums);
}

// scores[i][l] = dot(query i, key l) * factor for n queries and l < count, sixteen keys at a time so that each
// group of keys is read once for all the queries (the last group repeats the last key, unstored).
template <int kChunks, class Rows>
inline void scores(const float* const* queries, int n, const Rows& keys, int64_t count, float factor,
                   float* const* out) {
  const __m512 scale = _mm512_set1_ps(factor);
  const float* key[16];
  for (int64_t l = 0; l < count; l += 16) {
    const int64_t valid_keys = std::min<int64_t>(16, count - l);
    for (int i = 0; i < 16; ++i) key[i] = keys(l + std::min<int64_t>(i, valid_keys - 1));
    for (int64_t next = l + kKeyAhead; next < std::min<int64_t>(l + kKeyAhead + 16, count); ++next) {
      const char* row = reinterpret_cast<const char*>(keys(next));
      for (int c = 0; c < kChunks; ++c) _mm_prefetch(row + 64 * c, _MM_HINT_T0);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << valid_keys) - 1u);
    for (int i = 0; i < n; ++i) {
      __m512 q[kChunks];
      for (int c = 0; c < kChunks; ++c) q[c] = _mm512_loadu_ps(queries[i] + 16 * c);
      _mm512_mask_storeu_ps(out[i] + l, valid, _mm512_mul_ps(dot16<kChunks>(q, key), scale));
    }
  }
}

// exp(v) for 16 floats: the portable kernel's range reduction and polynomial, elementwise the same operations.
inline __m512 exp16(__m512 v) {
  const __m512 lowest = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(v, lowest, _CMP_LT_OQ);
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(v, lowest), _mm512_set1_ps(88.3f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}

// weights[l] = -inf where visible[l * stride] is false, sixteen keys at a time where the mask is contiguous.
inline void hide(float* weights, int64_t count, const bool* visible, int64_t stride) {
  int64_t l = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (stride == 1) {
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (; l + 16 <= count; l += 16) {
      const __mmask16 hidden = _mm_cmpeq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(visible + l)),
                                                   _mm_setzero_si128());
      _mm512_mask_storeu_ps(weights + l, hidden, minus_inf);
    }
  }
#endif
  for (; l < count; ++l) {
    if (!visible[l * stride]) weights[l] = -std::numeric_limits<float>::infinity();
  }
}

// weights[0:count] (raw scores, -inf where masked) -> exp(score - max) in place.
inline void softmax_numerators(float* weights, int64_t count) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = minus_inf;
  for (int64_t l = 0; l < count; l += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, count - l)) - 1u);
    best = _mm512_max_ps(best, _mm512_mask_loadu_ps(minus_inf, valid, weights + l));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t l = 0; l < count; l += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, count - l)) - 1u);
    const __m512 shifted = _mm512_sub_ps(_mm512_mask_loadu_ps(minus_inf, valid, weights + l), top);
    _mm512_mask_storeu_ps(weights + l, valid, exp16(shifted));
  }
}

// kQueries rows at once: out[q][0:16 * kChunks] = sum over keys l in order of weights[q][l] * value l, divided by
// the sum of weights[q]. Every key is added, a masked one with weight zero adding exactly nothing, so a row's sums
// are the same whatever masked keys lie between its visible ones. Each value row is loaded once for the kQueries.
template <int kChunks, int kQueries, class Rows>
inline void weighted_values(const float* const* weights, const Rows& values, int64_t count, float* const* out) {
  __m512 sums[kQueries][kChunks];
  float totals[kQueries];
  for (int q = 0; q < kQueries; ++q) {
    totals[q] = 0.0f;
    for (int c = 0; c < kChunks; ++c) sums[q][c] = _mm512_setzero_ps();
  }
  for (int64_t l = 0; l < count; ++l) {
    const float* row = values(l);
    if (l + kValueAhead < count) {
      const char* ahead = reinterpret_cast<const char*>(values(l + kValueAhead));
      for (int c = 0; c < kChunks; ++c) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
    }
    __m512 value[kChunks];
    for (int c = 0; c < kChunks; ++c) value[c] = _mm512_loadu_ps(row + 16 * c);
#pragma GCC unroll 4
    for (int q = 0; q < kQueries; ++q) {
      const float w = weights[q][l];
      const __m512 weight = _mm512_set1_ps(w);
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) sums[q][c] = _mm512_fmadd_ps(weight, value[c], sums[q][c]);
      totals[q] += w;
    }
  }
  for (int q = 0; q < kQueries; ++q) {
    const __m512 inverse = _mm512_set1_ps(totals[q] > 0.0f ? 1.0f / totals[q] : 0.0f);
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(out[q] + 16 * c, _mm512_mul_ps(sums[q][c], inverse));
  }
}

// n query rows of one key head: out[i][0:16 * kChunks] = softmax(q_i k^T * factor) v over `count` keys (row l of
// keys/values at keys(l)/values(l)); masks[i] (stride mask_stride, null: all visible) hides keys. weights: n
// scratch rows of `count` floats. Each group of keys, each value row, is read once for several query rows.
template <int kChunks, class Rows>
inline void attend(const float* const* queries, int n, const Rows& keys, const Rows& values, int64_t count,
                   float factor, const bool* const* masks, int64_t mask_stride, float* const* weights,
                   float* const* out) {
  scores<kChunks>(queries, n, keys, count, factor, weights);
  for (int i = 0; i < n; ++i) {
    if (masks[i] != nullptr) hide(weights[i], count, masks[i], mask_stride);
    softmax_numerators(weights[i], count);
  }
  constexpr int kGroup = kChunks <= 4 ? 3 : 2;  // rows per pass over the values: their sums fill the registers
  int i = 0;
  for (; i + kGroup <= n; i += kGroup) weighted_values<kChunks, kGroup>(weights + i, values, count, out + i);
  for (; i < n; ++i) weighted_values<kChunks, 1>(weights + i, values, count, out + i);
}

}  // namespace attention_rows
#endif
