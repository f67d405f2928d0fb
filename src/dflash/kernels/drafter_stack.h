// The layers of a DFlash drafter (`DrafterLayer` with joined projections) in one native call each for its two jobs:
// taking committed context rows into its cache (`DFlashDrafter.absorb_context`) and running a block of rows over
// that context (`DFlashDrafter.draft_hidden`), the Python layers' computation call for call (see cpu_decoder.cpp).
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernel_checks.h"
#include "native_layers.h"

namespace native_layers {

// DrafterLayer: x + attn(norm(x)) with the block's rows as queries and the context's keys before the block's own,
// then x + mlp(norm(x)); q/k norms, rotary, joined [q; k; v], [k; v] and [gate; up] products, SiLU.
struct DrafterLayer {
  int64_t index;  // the layer's place in the drafter's cache
  Norm input_norm, post_norm, q_norm, k_norm;
  Linear qkv, kv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
};

class DrafterStack {
 public:
  explicit DrafterStack(std::vector<DrafterLayer> layers) : layers_(std::move(layers)) {}

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // absorb_context's loop. ctx: [B, rows, hidden] (the projected, normed features); cos, sin: [B or 1, 1, rows,
  // head_dim]; keys, values: the drafter cache's [layers, B, kv_heads, capacity, head_dim]: every layer's keys and
  // values of the rows go to slots [length, length + rows) (KVCache.write of keys_values).
  void absorb(const torch::Tensor& ctx, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& keys,
              const torch::Tensor& values, int64_t length) const {
    check_bound();
    const int64_t rows = ctx.size(1);
    DFLASH_CHECK(length + rows <= keys.size(3), "the drafter cache holds ", keys.size(3), " slots, not ", length + rows);
    for (const DrafterLayer& layer : layers_) {
      const int64_t size = layer.kv_heads * layer.head_dim;
      const std::vector<torch::Tensor> kv = apply(layer.kv, ctx).split_with_sizes({size, size}, -1);
      const torch::Tensor k = rotated_keys(layer, kv[0], cos, sin);
      const torch::Tensor v = split_heads(layer, kv[1]);
      slots(keys, layer, length, rows).copy_(k);
      slots(values, layer, length, rows).copy_(v);
    }
  }

  // draft_hidden's loop. x: [B, block, hidden] (the block's embeddings); cos, sin: [B or 1, 1, block, head_dim];
  // keys, values: the drafter cache, slots [first, length) its context; the block's keys and values go to the
  // free slots [length, length + block); the last layer computes only the rows [q_start, q_stop) (all: q_start
  // < 0) -> x after the last layer (before the final norm).
  torch::Tensor block(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& keys,
                      const torch::Tensor& values, int64_t first, int64_t length, int64_t q_start,
                      int64_t q_stop) const {
    check_bound();
    const int64_t rows = x.size(1), end = length + rows, context_rows = length - first;
    DFLASH_CHECK(end <= keys.size(3), "the drafter cache holds ", keys.size(3), " slots, not ", end);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DrafterLayer& layer = layers_[i];
      const bool some = i + 1 == layers_.size() && q_start >= 0;  // the last layer's wanted rows alone
      // context_k, context_v: the cache's slots [first, end) of this layer (every head and lane)
      const torch::Tensor context_k = keys.select(0, layer.index).narrow(2, first, end - first);
      const torch::Tensor context_v = values.select(0, layer.index).narrow(2, first, end - first);
      // DrafterAttention.block_qkv with [q; k; v] joined
      const torch::Tensor h = normed(layer.input_norm, x);
      const int64_t q_size = layer.heads * layer.head_dim, kv_size = layer.kv_heads * layer.head_dim;
      const std::vector<torch::Tensor> qkv = apply(layer.qkv, h).split_with_sizes({q_size, kv_size, kv_size}, -1);
      const torch::Tensor block_k = rotated_keys(layer, qkv[1], cos, sin);
      const torch::Tensor block_v = split_heads(layer, qkv[2]);
      torch::Tensor projected_q = qkv[0];
      torch::Tensor q_cos = cos, q_sin = sin;
      if (some) {
        projected_q = projected_q.slice(1, q_start, q_stop);
        q_cos = cos.slice(2, q_start, q_stop);
        q_sin = sin.slice(2, q_start, q_stop);
      }
      const int64_t batch = projected_q.size(0), queries = projected_q.size(1);
      const torch::Tensor q = functions.rotary(
          normed(layer.q_norm, projected_q.view({batch, queries, layer.heads, layer.head_dim})).transpose(1, 2),
          q_cos, q_sin);
      // DrafterAttention.forward: the block's keys and values after the context, in place
      context_k.slice(2, context_rows, end - first).copy_(block_k);
      context_v.slice(2, context_rows, end - first).copy_(block_v);
      const torch::Tensor attended = functions.attention(q, context_k, context_v, c10::nullopt,
                                                         std::pow(static_cast<double>(layer.head_dim), -0.5));
      x = (some ? x.slice(1, q_start, q_stop) : x) + apply(layer.o, attended);
      x = x + apply(layer.down, functions.silu_mul(apply(layer.gate_up, normed(layer.post_norm, x))));
    }
    return x;
  }

 private:
  static void check_bound() {
    DFLASH_CHECK(functions.rms_norm && functions.rotary && functions.attention && functions.silu_mul,
                "the fused layer operations are not bound");
  }

  // [B, rows, kv_heads * head_dim] -> k_norm, rotated: [B, kv_heads, rows, head_dim] (DrafterAttention._keys)
  static torch::Tensor rotated_keys(const DrafterLayer& layer, const torch::Tensor& k, const torch::Tensor& cos,
                                    const torch::Tensor& sin) {
    const torch::Tensor heads = k.view({k.size(0), k.size(1), layer.kv_heads, layer.head_dim});
    return functions.rotary(normed(layer.k_norm, heads).transpose(1, 2), cos, sin);
  }

  // [B, rows, kv_heads * head_dim] -> [B, kv_heads, rows, head_dim] (DrafterAttention._values)
  static torch::Tensor split_heads(const DrafterLayer& layer, const torch::Tensor& v) {
    return v.view({v.size(0), v.size(1), layer.kv_heads, layer.head_dim}).transpose(1, 2);
  }

  // keys[layer, :, :heads, start:start + rows, :width], as KVCache.write stores them
  static torch::Tensor slots(const torch::Tensor& cache, const DrafterLayer& layer, int64_t start, int64_t rows) {
    return cache.select(0, layer.index).narrow(1, 0, layer.kv_heads).narrow(2, start, rows).narrow(3, 0, layer.head_dim);
  }

  std::vector<DrafterLayer> layers_;
};

}  // namespace native_layers
