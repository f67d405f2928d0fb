// Fused float32 CPU operations of a decoder layer: RMSNorm, rotary embedding, attention over a KV cache and the
// gated MLP's activation.
//
// On a CPU a one-token step of a small model spends a large share of its time outside the matrix products:
// every torch operation costs microseconds of dispatch whatever its size, and a layer issues dozens of them.
// Each function here replaces a chain of such operations by one call.
//
// Row invariance: every output row is computed from its own input row (and, for attention, the keys and values it
// may see) by one code path in one order, whatever the number of rows or threads, so a row of a verification is
// bitwise equal to the same row computed alone. Multiply-add contraction is disabled at build time
// (-ffp-contract=off), so `a * b + c * d` rounds each product as torch's separate multiply and add do.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "attention_rows.h"
#include "kernel_checks.h"
#include "packed_segments.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // partial sums per reduction (fixed, so the order never depends on the machine)

// Dot product of two float vectors of length n: kLanes interleaved partial sums, then added in a fixed order.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma GCC unroll 8
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  for (; i < n; ++i) lanes[i % kLanes] += a[i] * b[i];
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// exp(x) for n floats in place. AVX2: range reduction x = k ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial
// for exp(r) (the Cephes single-precision coefficients; tests hold it to SDPA and torch's SiLU); inputs below
// -87.3 give 0 (they are scores far below the row's maximum). Every element takes that path, the last n % 8 too
// (through a padded copy): a key's weight must not depend on how many keys the row holds, or a row verified
// beside later (masked) keys would differ from the same row decoded alone. Without AVX2, std::exp for all.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 v) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 highest = _mm256_set1_ps(88.3f);
  const __m256 c1 = _mm256_set1_ps(1.0f), c2 = _mm256_set1_ps(0.5f);
  const __m256 c3 = _mm256_set1_ps(1.6666665459e-1f), c4 = _mm256_set1_ps(4.1665795894e-2f);
  const __m256 c5 = _mm256_set1_ps(8.3334519073e-3f), c6 = _mm256_set1_ps(1.3981999507e-3f);
  const __m256 c7 = _mm256_set1_ps(1.9875691500e-4f);
  const __m256 under = _mm256_cmp_ps(v, lowest, _CMP_LT_OQ);
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(v, lowest), highest);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(clamped, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, ln2_hi, clamped);
  r = _mm256_fnmadd_ps(k, ln2_lo, r);
  __m256 p = c7;
  p = _mm256_fmadd_ps(p, r, c6);
  p = _mm256_fmadd_ps(p, r, c5);
  p = _mm256_fmadd_ps(p, r, c4);
  p = _mm256_fmadd_ps(p, r, c3);
  p = _mm256_fmadd_ps(p, r, c2);
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, c1);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(under, result);
}
#endif

void exp_in_place(float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(x + i, x + n, tail);
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    std::copy(tail, tail + (n - i), x + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

// scores[l] = dot(query, keys(l)) * factor for l < count. Four keys at a time, each key's dot product in kLanes
// lanes added in a fixed order (the same per key whatever the count or the key's address).
template <class Rows>
void scores_of(const float* query, const Rows& keys, int64_t count, int64_t d, float factor, float* scores) {
  int64_t l = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (; l + 4 <= count; l += 4) {
      const float* k0 = keys(l);
      const float* k1 = keys(l + 1);
      const float* k2 = keys(l + 2);
      const float* k3 = keys(l + 3);
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(query + i);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, _mm256_loadu_ps(k0 + i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, _mm256_loadu_ps(k1 + i)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, _mm256_loadu_ps(k2 + i)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, _mm256_loadu_ps(k3 + i)));
      }
      const __m256 partial[4] = {a0, a1, a2, a3};
      for (int j = 0; j < 4; ++j) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, partial[j]);
        float total = 0.0f;
        for (int64_t x = 0; x < kLanes; ++x) total += lanes[x];
        scores[l + j] = total * factor;
      }
    }
  }
#endif
  for (; l < count; ++l) scores[l] = dot(query, keys(l), d) * factor;
}

// acc[0:d] = sum over keys l of weights[l] * values(l)[0:d], keys in order, zero weights skipped.
// With AVX2 and d = 64 the sums stay in registers; the operations per element are the same either way.
template <class Rows>
void weighted_values(const float* weights, const Rows& values, int64_t count, int64_t d, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) {
    __m256 sums[8];
    for (int j = 0; j < 8; ++j) sums[j] = _mm256_setzero_ps();
    for (int64_t l = 0; l < count; ++l) {
      if (weights[l] == 0.0f) continue;
      const __m256 w = _mm256_set1_ps(weights[l]);
      const float* value = values(l);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) sums[j] = _mm256_add_ps(sums[j], _mm256_mul_ps(w, _mm256_loadu_ps(value + 8 * j)));
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + 8 * j, sums[j]);
    return;
  }
#endif
  std::fill(acc, acc + d, 0.0f);
  for (int64_t l = 0; l < count; ++l) {
    const float w = weights[l];
    if (w == 0.0f) continue;
    const float* value = values(l);
    for (int64_t j = 0; j < d; ++j) acc[j] += w * value[j];
  }
}

void check_float_cpu(const torch::Tensor& t, const char* name) {
  DFLASH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
}

// Work units per task for at::parallel_for: small problems stay on the calling thread.
int64_t grain(int64_t units, int64_t cost_per_unit) {
  constexpr int64_t kWorkPerTask = 1 << 16;
  return std::max<int64_t>(1, std::min<int64_t>(units, kWorkPerTask / std::max<int64_t>(1, cost_per_unit)));
}

// One entry of an attention call (a batch row, or one request's rows in a packed forward): row s of query head h at
// q + h * q_head_stride + s * q_row_stride; key l of row s visible where visible[s * mask_row_stride + l *
// mask_key_stride] (null: every key visible); its output row s, head h at out + s * out_row_stride + h * d.
struct AttentionEntry {
  int64_t seq, keys;
  const float* q;
  int64_t q_head_stride, q_row_stride;
  const bool* visible;
  int64_t mask_row_stride, mask_key_stride;
  float* out;
  int64_t out_row_stride;
};

// softmax(q k^T * factor) v for every row of every entry, in one parallel region; keys_of(e, kh) and values_of(e,
// kh) give the addressing functor (row l -> its head_dim floats) of key head kh of entry e. Query head h reads key
// head h / (heads / kv_heads). A row's arithmetic does not depend on the rows computed beside it (see
// attention_rows.h), so entries can be split into work units in any way.
template <class KeysOf, class ValuesOf>
void attend_entries(const std::vector<AttentionEntry>& entries, int64_t heads, int64_t d, int64_t kv_heads,
                    float factor, const KeysOf& keys_of, const ValuesOf& values_of) {
  const int64_t group = heads / kv_heads, count = static_cast<int64_t>(entries.size());
#if defined(__AVX512F__)
  if (d == 64 || d == 128) {
    using Rows = decltype(keys_of(int64_t{0}, int64_t{0}));
    // Work units: query rows (heads of the group x sequence rows) of one key head of one entry, each entry's in
    // slices so that every thread has work; a unit reads its key head's keys and values once for all its rows.
    struct Unit {
      int64_t entry, kh, first, n;
    };
    std::vector<Unit> units;
    const int64_t share = (2 * at::get_num_threads() + count * kv_heads - 1) / std::max<int64_t>(1, count * kv_heads);
    int64_t most_rows = 0, most_weights = 0;
    for (int64_t e = 0; e < count; ++e) {
      const int64_t rows_per_head = group * entries[e].seq;
      if (rows_per_head == 0) continue;
      const int64_t parts = std::min<int64_t>(rows_per_head, share);
      const int64_t per_part = (rows_per_head + parts - 1) / parts;
      most_rows = std::max(most_rows, per_part);
      most_weights = std::max(most_weights, per_part * entries[e].keys);
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        for (int64_t first = 0; first < rows_per_head; first += per_part) {
          units.push_back({e, kh, first, std::min(per_part, rows_per_head - first)});
        }
      }
    }
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(most_weights));
      std::vector<const float*> queries(most_rows);
      std::vector<const bool*> masks(most_rows);
      std::vector<float*> weights(most_rows), outs(most_rows);
      for (int64_t u = begin; u < end; ++u) {
        const Unit& unit = units[u];
        const AttentionEntry& e = entries[unit.entry];
        for (int64_t i = 0; i < unit.n; ++i) {
          const int64_t h = unit.kh * group + (unit.first + i) / e.seq, s = (unit.first + i) % e.seq;
          queries[i] = e.q + h * e.q_head_stride + s * e.q_row_stride;
          masks[i] = e.visible == nullptr ? nullptr : e.visible + s * e.mask_row_stride;
          weights[i] = scratch.data() + i * e.keys;
          outs[i] = e.out + s * e.out_row_stride + h * d;
        }
        (d == 64 ? attention_rows::attend<4, Rows> : attention_rows::attend<8, Rows>)(
            queries.data(), static_cast<int>(unit.n), keys_of(unit.entry, unit.kh), values_of(unit.entry, unit.kh),
            e.keys, factor, masks.data(), e.mask_key_stride, weights.data(), outs.data());
      }
    });
    return;
  }
#endif
  // One unit per query row: entry e's rows are units [offsets[e], offsets[e + 1]).
  std::vector<int64_t> offsets(count + 1, 0);
  int64_t most_keys = 0;
  for (int64_t e = 0; e < count; ++e) {
    offsets[e + 1] = offsets[e] + heads * entries[e].seq;
    most_keys = std::max(most_keys, entries[e].keys);
  }
  const int64_t units = offsets[count];
  at::parallel_for(0, units, grain(units, 4 * most_keys * d), [&](int64_t begin, int64_t end) {
    std::vector<float> weights(static_cast<size_t>(most_keys));
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t u = begin; u < end; ++u) {
      const int64_t index = std::upper_bound(offsets.begin(), offsets.end(), u) - offsets.begin() - 1;
      const AttentionEntry& e = entries[index];
      const int64_t row = u - offsets[index], h = row / e.seq, s = row % e.seq, kh = h / group, keys = e.keys;
      const float* query = e.q + h * e.q_head_stride + s * e.q_row_stride;
      const bool* row_mask = e.visible == nullptr ? nullptr : e.visible + s * e.mask_row_stride;
      float* dst = e.out + s * e.out_row_stride + h * d;
      scores_of(query, keys_of(index, kh), keys, d, factor, weights.data());
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < keys; ++l) {
        if (row_mask != nullptr && !row_mask[l * e.mask_key_stride]) {
          weights[l] = -std::numeric_limits<float>::infinity();
        } else {
          best = std::max(best, weights[l]);
        }
      }
      for (int64_t l = 0; l < keys; ++l) weights[l] -= best;  // masked keys stay -inf
      exp_in_place(weights.data(), keys);
      float total = 0.0f;
      for (int64_t l = 0; l < keys; ++l) total += weights[l];
      weighted_values(weights.data(), values_of(index, kh), keys, d, acc.data());
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t j = 0; j < d; ++j) dst[j] = acc[j] * inverse;
    }
  });
}

// A request's keys as pool slots: the slots checked in range, contiguous.
torch::Tensor checked_slots(const torch::Tensor& slots, int64_t pool) {
  DFLASH_CHECK(slots.device().is_cpu() && slots.scalar_type() == torch::kLong && slots.dim() == 1,
              "slots must be a 1-D int64 CPU tensor");
  torch::Tensor order = slots.contiguous();
  const int64_t* slot = order.data_ptr<int64_t>();
  for (int64_t l = 0; l < order.size(0); ++l) {
    DFLASH_CHECK(slot[l] >= 0 && slot[l] < pool, "slot ", slot[l], " at ", l, " is outside the pool of ", pool);
  }
  return order;
}

// The pool attention's operands: q [H, S, D], k_pool and v_pool [KVH, P, D] (any strides but contiguous in D).
void check_pool_operands(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool) {
  check_float_cpu(q, "q");
  check_float_cpu(k_pool, "k_pool");
  check_float_cpu(v_pool, "v_pool");
  DFLASH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q, k_pool and v_pool must be 3-D");
  DFLASH_CHECK(v_pool.sizes() == k_pool.sizes() && k_pool.size(2) == q.size(2),
              "k_pool and v_pool must both be [kv_heads, slots, head_dim] matching q");
  DFLASH_CHECK(k_pool.size(0) > 0 && q.size(0) % k_pool.size(0) == 0, "query heads must be a multiple of key heads");
  DFLASH_CHECK(q.stride(2) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1,
              "q, k_pool and v_pool must be contiguous in head_dim");
}

// The entry of `count` query rows of q [H, S, D] from row `start`, over `keys` keys under mask (bool [count, keys]).
AttentionEntry pool_entry(const torch::Tensor& q, int64_t start, int64_t count, int64_t keys,
                          const c10::optional<torch::Tensor>& mask, float* out) {
  const bool* visible = nullptr;
  int64_t mask_row_stride = 0, mask_key_stride = 0;
  if (mask.has_value()) {
    const torch::Tensor& m = *mask;
    DFLASH_CHECK(m.device().is_cpu() && m.scalar_type() == torch::kBool, "mask must be bool on the CPU");
    DFLASH_CHECK(m.dim() == 2 && m.size(0) == count && m.size(1) == keys, "mask must be [rows, keys]");
    visible = m.data_ptr<bool>();
    mask_row_stride = m.stride(0);
    mask_key_stride = m.stride(1);
  }
  const int64_t heads = q.size(0), d = q.size(2);
  return AttentionEntry{count, keys, q.data_ptr<float>() + start * q.stride(1), q.stride(0), q.stride(1), visible,
                        mask_row_stride, mask_key_stride, out + start * heads * d, heads * d};
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool adds_one) {
  // x: [..., D], weight: [D] -> [..., D]: x * rsqrt(mean(x^2) + eps) * weight (Gemma: * (1 + weight))
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  const int64_t d = x.size(-1);
  DFLASH_CHECK(weight.dim() == 1 && weight.size(0) == d, "weight must have ", d, " values");
  const torch::Tensor input = x.contiguous();
  const torch::Tensor w = weight.contiguous();
  torch::Tensor out = torch::empty_like(input);
  const int64_t rows = d == 0 ? 0 : input.numel() / d;
  const float* xs = input.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(rows, 4 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> scale(static_cast<size_t>(d));
    for (int64_t i = 0; i < d; ++i) scale[i] = adds_one ? 1.0f + ws[i] : ws[i];
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * d;
      float* dst = ys + r * d;
      const float inverse = 1.0f / std::sqrt(dot(row, row, d) / static_cast<float>(d) + epsilon);
      for (int64_t i = 0; i < d; ++i) dst[i] = (row[i] * inverse) * scale[i];
    }
  });
  return out;
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  // x: [B, H, S, D] (any strides); cos, sin: [B or 1, 1, S, D] -> [B, H, S, D] contiguous, rotate-half pairing:
  // out[j] = x[j] * cos[j] + (-x[j + D/2]) * sin[j], out[j + D/2] = x[j + D/2] * cos[j + D/2] + x[j] * sin[j + D/2]
  check_float_cpu(x, "x");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  DFLASH_CHECK(x.dim() == 4 && cos.dim() == 4 && sin.dim() == 4, "x, cos and sin must be 4-D");
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), d = x.size(3), half = d / 2;
  DFLASH_CHECK(d % 2 == 0, "head_dim must be even");
  DFLASH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == 1 && cos.size(2) == seq && cos.size(3) == d &&
                  (cos.size(0) == 1 || cos.size(0) == batch),
              "cos and sin must be [batch or 1, 1, seq, head_dim]");
  DFLASH_CHECK(x.stride(3) == 1, "x must be contiguous in its last dimension");
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  torch::Tensor out = torch::empty({batch, heads, seq, d}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* cs = c.data_ptr<float>();
  const float* ss = s.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), sq = x.stride(2);
  const bool shared_angles = c.size(0) == 1;
  const int64_t rows = batch * heads * seq;
  at::parallel_for(0, rows, grain(rows, 4 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (heads * seq), h = (r / seq) % heads, q = r % seq;
      const float* src = xs + b * sb + h * sh + q * sq;
      const int64_t angle_row = ((shared_angles ? 0 : b) * seq + q) * d;
      const float* cr = cs + angle_row;
      const float* sr = ss + angle_row;
      float* dst = ys + r * d;
      for (int64_t j = 0; j < half; ++j) {
        dst[j] = src[j] * cr[j] + (-src[j + half]) * sr[j];
        dst[j + half] = src[j + half] * cr[j + half] + src[j] * sr[j + half];
      }
    }
  });
  return out;
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  // q: [B, H, S, D]; k, v: [B, KVH, L, D] (H a multiple of KVH; query head h reads key head h / (H / KVH));
  // mask: optional bool [B or 1, 1, S, L], true = visible (none: every key visible)
  // -> [B, S, H * D] contiguous: softmax(q k^T * scale) v per query row, in float32.
  check_float_cpu(q, "q");
  check_float_cpu(k, "k");
  check_float_cpu(v, "v");
  DFLASH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k and v must be 4-D");
  const int64_t batch = q.size(0), heads = q.size(1), seq = q.size(2), d = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  DFLASH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == kv_heads && v.size(2) == keys &&
                  k.size(3) == d && v.size(3) == d,
              "k and v must be [batch, kv_heads, keys, head_dim] matching q");
  DFLASH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of key heads");
  DFLASH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "q, k and v must be contiguous in head_dim");
  const bool* visible = nullptr;
  int64_t mask_batch_stride = 0, mask_row_stride = 0, mask_key_stride = 0;
  torch::Tensor mask_tensor;
  if (mask.has_value()) {
    mask_tensor = *mask;
    DFLASH_CHECK(mask_tensor.device().is_cpu() && mask_tensor.scalar_type() == torch::kBool, "mask must be bool on the CPU");
    DFLASH_CHECK(mask_tensor.dim() == 4 && (mask_tensor.size(0) == 1 || mask_tensor.size(0) == batch) &&
                    mask_tensor.size(1) == 1 && mask_tensor.size(2) == seq && mask_tensor.size(3) == keys,
                "mask must be [batch or 1, 1, seq, keys]");
    visible = mask_tensor.data_ptr<bool>();
    mask_batch_stride = mask_tensor.size(0) == 1 ? 0 : mask_tensor.stride(0);
    mask_row_stride = mask_tensor.stride(2);
    mask_key_stride = mask_tensor.stride(3);
  }
  torch::Tensor out = torch::empty({batch, seq, heads * d}, q.options());
  std::vector<AttentionEntry> entries;
  entries.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    entries.push_back({seq, keys, q.data_ptr<float>() + b * q.stride(0), q.stride(1), q.stride(2),
                       visible == nullptr ? nullptr : visible + b * mask_batch_stride, mask_row_stride,
                       mask_key_stride, out.data_ptr<float>() + b * seq * heads * d, heads * d});
  }
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const int64_t kb = k.stride(0), kh_ = k.stride(1), kl = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vl = v.stride(2);
  attend_entries(
      entries, heads, d, kv_heads, static_cast<float>(scale),
      [&](int64_t b, int64_t kh) { return attention_rows::StridedRows{ks + b * kb + kh * kh_, kl}; },
      [&](int64_t b, int64_t kh) { return attention_rows::StridedRows{vs + b * vb + kh * vh, vl}; });
  return out;
}

torch::Tensor attention_slots(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& slots, const c10::optional<torch::Tensor>& mask, double scale) {
  // q: [H, S, D]; k_pool, v_pool: [KVH, P, D] (one layer of a paged pool, any strides but contiguous in D);
  // slots: int64 [L], the request's keys in its own order, each in [0, P); mask: optional bool [S, L], true =
  // visible -> [S, H * D] contiguous, bitwise attention(q[None], k_pool[:, slots][None], v_pool[:, slots][None],
  // mask[None, None], scale): the same rows and arithmetic, the keys and values read in place through the slots.
  check_pool_operands(q, k_pool, v_pool);
  const torch::Tensor order = checked_slots(slots, k_pool.size(1));
  torch::Tensor out = torch::empty({q.size(1), q.size(0) * q.size(2)}, q.options());
  const std::vector<AttentionEntry> entries{pool_entry(q, 0, q.size(1), order.size(0), mask, out.data_ptr<float>())};
  const int64_t* slot = order.data_ptr<int64_t>();
  const float* ks = k_pool.data_ptr<float>();
  const float* vs = v_pool.data_ptr<float>();
  const int64_t kh_ = k_pool.stride(0), kl = k_pool.stride(1), vh = v_pool.stride(0), vl = v_pool.stride(1);
  attend_entries(
      entries, q.size(0), q.size(2), k_pool.size(0), static_cast<float>(scale),
      [&](int64_t, int64_t kh) { return attention_rows::SlotRows{ks + kh * kh_, kl, slot}; },
      [&](int64_t, int64_t kh) { return attention_rows::SlotRows{vs + kh * vh, vl, slot}; });
  return out;
}

torch::Tensor attention_segments(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                 const std::vector<packed::Segment>& segments, double scale) {
  // q: [H, R, D], every request's rows packed; k_pool, v_pool: [KVH, P, D]; segments: the requests' rows in order,
  // together rows [0, R) -> [R, H * D] contiguous, bitwise each segment's attention_slots(q[:, start:start + count],
  // k_pool, v_pool, read_slots, mask, scale) side by side, in one parallel region.
  check_pool_operands(q, k_pool, v_pool);
  torch::Tensor out = torch::empty({q.size(1), q.size(0) * q.size(2)}, q.options());
  std::vector<torch::Tensor> orders;
  std::vector<AttentionEntry> entries;
  orders.reserve(segments.size());
  entries.reserve(segments.size());
  int64_t next = 0;
  for (const packed::Segment& segment : segments) {
    DFLASH_CHECK(segment.start == next && segment.count >= 0, "segments must cover the rows in order: one starts at ",
                segment.start, ", not ", next);
    next += segment.count;
    DFLASH_CHECK(next <= q.size(1), "segments cover ", next, " rows, q has ", q.size(1));
    orders.push_back(checked_slots(segment.read_slots, k_pool.size(1)));
    entries.push_back(
        pool_entry(q, segment.start, segment.count, orders.back().size(0), segment.mask, out.data_ptr<float>()));
  }
  DFLASH_CHECK(next == q.size(1), "segments cover ", next, " rows, q has ", q.size(1));
  std::vector<const int64_t*> slots;
  for (const torch::Tensor& order : orders) slots.push_back(order.data_ptr<int64_t>());
  const float* ks = k_pool.data_ptr<float>();
  const float* vs = v_pool.data_ptr<float>();
  const int64_t kh_ = k_pool.stride(0), kl = k_pool.stride(1), vh = v_pool.stride(0), vl = v_pool.stride(1);
  attend_entries(
      entries, q.size(0), q.size(2), k_pool.size(0), static_cast<float>(scale),
      [&](int64_t e, int64_t kh) { return attention_rows::SlotRows{ks + kh * kh_, kl, slots[e]}; },
      [&](int64_t e, int64_t kh) { return attention_rows::SlotRows{vs + kh * vh, vl, slots[e]}; });
  return out;
}

torch::Tensor attention_segments_lists(const torch::Tensor& q, const torch::Tensor& k_pool,
                                       const torch::Tensor& v_pool, const std::vector<int64_t>& starts,
                                       const std::vector<int64_t>& counts, const std::vector<torch::Tensor>& slots,
                                       const std::vector<c10::optional<torch::Tensor>>& masks, double scale) {
  DFLASH_CHECK(counts.size() == starts.size() && slots.size() == starts.size() && masks.size() == starts.size(),
              "starts, counts, slots and masks must have one entry per segment");
  std::vector<packed::Segment> segments;
  segments.reserve(starts.size());
  for (size_t i = 0; i < starts.size(); ++i) segments.push_back({starts[i], counts[i], slots[i], masks[i]});
  return attention_segments(q, k_pool, v_pool, segments, scale);
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  // gate_up: [..., 2I] -> [..., I]: silu(gate) * up with gate the first I values, up the last I
  check_float_cpu(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1);
  DFLASH_CHECK(width % 2 == 0, "gate_up must have an even last dimension");
  const torch::Tensor input = gate_up.contiguous();
  const int64_t half = width / 2, rows = width == 0 ? 0 : input.numel() / width;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = half;
  torch::Tensor out = torch::empty(shape, input.options());
  const float* xs = input.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(rows, 8 * half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xs + r * width;
      const float* up = gate + half;
      float* dst = ys + r * half;
      for (int64_t i = 0; i < half; ++i) dst[i] = -gate[i];
      exp_in_place(dst, half);
      for (int64_t i = 0; i < half; ++i) dst[i] = gate[i] / (1.0f + dst[i]) * up[i];
    }
  });
  return out;
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  // logits: [rows, vocab] -> int64 [rows]: torch.argmax(logits, dim=-1), the first index of the maximum, or of the
  // first NaN where a row holds one (torch ranks NaN above every number).
  check_float_cpu(logits, "logits");
  DFLASH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  const torch::Tensor input = logits.contiguous();
  const int64_t rows = input.size(0), vocab = input.size(1);
  torch::Tensor out = torch::empty({rows}, input.options().dtype(torch::kLong));
  const float* xs = input.data_ptr<float>();
  int64_t* ys = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(rows, vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * vocab;
      int64_t best = 0;
      int64_t i = 0;
      bool unordered = false;
#if defined(__AVX512F__)
      // Per lane the first index of that lane's maximum (strictly greater replaces), then the smallest index among
      // the lanes holding the overall maximum. NaNs are only detected here and searched for below.
      if (vocab >= 16) {
        __m512 top = _mm512_loadu_ps(row);
        __m512i top_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i index = top_index;
        __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
        const __m512i step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= vocab; i += 16) {
          const __m512 x = _mm512_loadu_ps(row + i);
          index = _mm512_add_epi32(index, step);
          const __mmask16 greater = _mm512_cmp_ps_mask(x, top, _CMP_GT_OQ);
          top = _mm512_mask_mov_ps(top, greater, x);
          top_index = _mm512_mask_mov_epi32(top_index, greater, index);
          nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        }
        unordered = nan != 0;
        const float best_value = _mm512_reduce_max_ps(top);
        const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(holders, top_index);
      }
#endif
      for (; i < vocab; ++i) {
        if (row[i] > row[best]) best = i;
        unordered = unordered || std::isnan(row[i]);
      }
      if (unordered) {
        for (best = 0; !std::isnan(row[best]); ++best) {
        }
      }
      ys[r] = best;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.doc() = "Fused float32 CPU operations of a decoder layer (row invariant)";
  module.def("rms_norm", &rms_norm, "x [..., D] -> RMSNorm(x) * weight", py::arg("x"), py::arg("weight"),
             py::arg("eps"), py::arg("adds_one"), py::call_guard<py::gil_scoped_release>());
  module.def("rotary", &rotary, "x [B, H, S, D] rotated (rotate-half) -> contiguous", py::arg("x"), py::arg("cos"),
             py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  module.def("attention", &attention, "softmax(q k^T * scale) v -> [B, S, H * D]", py::arg("q"), py::arg("k"),
             py::arg("v"), py::arg("mask"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  module.def("attention_slots", &attention_slots,
             "softmax(q k^T * scale) v with k, v read from a pool through slots -> [S, H * D]", py::arg("q"),
             py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"), py::arg("mask"), py::arg("scale"),
             py::call_guard<py::gil_scoped_release>());
  module.def("attention_segments", &attention_segments_lists,
             "attention_slots over every request's rows of a packed forward at once -> [R, H * D]", py::arg("q"),
             py::arg("k_pool"), py::arg("v_pool"), py::arg("starts"), py::arg("counts"), py::arg("slots"),
             py::arg("masks"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  module.def("silu_mul", &silu_mul, "silu(gate) * up", py::arg("gate_up"), py::call_guard<py::gil_scoped_release>());
  module.def("argmax_rows", &argmax_rows, "[rows, vocab] -> first index of each row's maximum", py::arg("logits"),
             py::call_guard<py::gil_scoped_release>());
  // for the native decoder layers (cpu_decoder.cpp), which call these very functions
  module.attr("rms_norm_capsule") = py::capsule(reinterpret_cast<void*>(&rms_norm), "dflash.rms_norm");
  module.attr("rotary_capsule") = py::capsule(reinterpret_cast<void*>(&rotary), "dflash.rotary");
  module.attr("attention_capsule") = py::capsule(reinterpret_cast<void*>(&attention), "dflash.attention");
  module.attr("attention_segments_capsule") =
      py::capsule(reinterpret_cast<void*>(&attention_segments), "dflash.attention_segments");
  module.attr("silu_mul_capsule") = py::capsule(reinterpret_cast<void*>(&silu_mul), "dflash.silu_mul");
}
