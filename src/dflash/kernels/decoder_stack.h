// The decoder layers of a Llama / Qwen3 target (`DecoderLayer`) over a KV cache or the batched core's pool, the
// Python layers' computation call for call (see cpu_decoder.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kernel_checks.h"
#include "native_layers.h"
#include "packed_segments.h"

namespace native_layers {

// DecoderLayer: x + attn(norm(x)), then x + mlp(norm(x)), attention with fused QKV, optional q/k norms, rotary,
// the new K/V stored in the cache, SiLU-gated MLP.
struct Layer {
  int64_t index;  // the layer's place in the cache
  Norm input_norm, post_norm;
  std::optional<Norm> q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
  double scale;
};

using packed::Segment;

class DecoderStack {
 public:
  explicit DecoderStack(std::vector<Layer> layers) : layers_(std::move(layers)) {}

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // Into a KVCache. x: [B, S, hidden]; cos, sin: [B or 1, 1, S, head_dim]; mask: bool [B or 1, 1, S, length + S]
  // or none (every key visible); keys, values: the cache's [layers, B, kv_heads, capacity, head_dim], slots
  // [0, length) committed -> (x after the last layer, x after each layer of `capture`, in that order). The new
  // K/V go to slots [length, length + S) (KVCache.write, then Attention.attend).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run(const torch::Tensor& x, const torch::Tensor& cos,
                                                            const torch::Tensor& sin,
                                                            const c10::optional<torch::Tensor>& mask,
                                                            const torch::Tensor& keys, const torch::Tensor& values,
                                                            int64_t length, const std::vector<int64_t>& capture) const {
    DFLASH_CHECK(x.dim() == 3, "x must be [batch, seq, hidden]");
    const int64_t seq = x.size(1), end = length + seq;
    DFLASH_CHECK(end <= keys.size(3), "the cache holds ", keys.size(3), " slots, not ", end);
    return layers(x, cos, sin, capture, [&](const Layer& layer, const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v) {
      const torch::Tensor layer_keys = keys.select(0, layer.index).narrow(1, 0, layer.kv_heads);
      const torch::Tensor layer_values = values.select(0, layer.index).narrow(1, 0, layer.kv_heads);
      layer_keys.narrow(2, length, seq).narrow(3, 0, layer.head_dim).copy_(k);
      layer_values.narrow(2, length, seq).narrow(3, 0, layer.head_dim).copy_(v);
      const torch::Tensor seen_keys = layer_keys.narrow(2, 0, end).narrow(3, 0, layer.head_dim);
      const torch::Tensor seen_values = layer_values.narrow(2, 0, end).narrow(3, 0, layer.head_dim);
      return functions.attention(q, seen_keys, seen_values, mask, layer.scale);
    });
  }

  // Into the batched core's pool (`PackedAttention.attend`). x: [1, rows, hidden], the requests' rows packed;
  // pool_keys, pool_values: [layers, kv_heads, slots, head_dim]; write_slots: int64 [rows], where each row's K/V go;
  // segments: each request's rows and what they read.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run_packed(
      const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pool_keys,
      const torch::Tensor& pool_values, const torch::Tensor& write_slots, const std::vector<Segment>& segments,
      const std::vector<int64_t>& capture) const {
    DFLASH_CHECK(x.dim() == 3 && x.size(0) == 1, "x must be [1, rows, hidden]");
    DFLASH_CHECK(functions.attention_segments != nullptr, "the fused layer operations are not bound");
    DFLASH_CHECK(!segments.empty(), "a packed forward has a segment at least");
    return layers(x, cos, sin, capture, [&](const Layer& layer, const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v) {
      torch::Tensor keys = pool_keys.select(0, layer.index).narrow(0, 0, layer.kv_heads).narrow(2, 0, layer.head_dim);
      torch::Tensor values =
          pool_values.select(0, layer.index).narrow(0, 0, layer.kv_heads).narrow(2, 0, layer.head_dim);
      keys.index_copy_(1, write_slots, k.select(0, 0));
      values.index_copy_(1, write_slots, v.select(0, 0));
      // every request's rows in one call (one parallel region a layer, whatever the number of requests)
      return functions.attention_segments(q.select(0, 0), keys, values, segments, layer.scale).unsqueeze(0);
    });
  }

 private:
  // Every layer over x, `attend(layer, q, k, v)` storing the new K/V and attending -> [B, S, heads * head_dim].
  template <class Attend>
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> layers(torch::Tensor x, const torch::Tensor& cos,
                                                               const torch::Tensor& sin,
                                                               const std::vector<int64_t>& capture,
                                                               Attend&& attend) const {
    DFLASH_CHECK(functions.rms_norm && functions.rotary && functions.attention && functions.silu_mul,
                "the fused layer operations are not bound");
    const int64_t batch = x.size(0), seq = x.size(1);
    std::vector<torch::Tensor> captured(capture.size());
    for (const Layer& layer : layers_) {
      const int64_t q_size = layer.heads * layer.head_dim, kv_size = layer.kv_heads * layer.head_dim;
      const torch::Tensor qkv = apply(layer.qkv, normed(layer.input_norm, x));  // [B, S, q + 2 kv]
      const std::vector<torch::Tensor> split = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      torch::Tensor q = split[0].view({batch, seq, layer.heads, layer.head_dim});
      torch::Tensor k = split[1].view({batch, seq, layer.kv_heads, layer.head_dim});
      if (layer.q_norm.has_value() && layer.k_norm.has_value()) {
        q = normed(*layer.q_norm, q);
        k = normed(*layer.k_norm, k);
      }
      q = functions.rotary(q.transpose(1, 2), cos, sin);  // [B, heads, S, head_dim]
      k = functions.rotary(k.transpose(1, 2), cos, sin);  // [B, kv_heads, S, head_dim]
      const torch::Tensor v = split[2].view({batch, seq, layer.kv_heads, layer.head_dim}).transpose(1, 2);
      x = x + apply(layer.o, attend(layer, q, k, v));
      const torch::Tensor gate_up = apply(layer.gate_up, normed(layer.post_norm, x));
      x = x + apply(layer.down, functions.silu_mul(gate_up));
      for (size_t i = 0; i < capture.size(); ++i) {
        if (capture[i] == layer.index) captured[i] = x;
      }
    }
    return {x, captured};
  }

  std::vector<Layer> layers_;
};

}  // namespace native_layers
