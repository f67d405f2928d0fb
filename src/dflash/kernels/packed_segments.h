// One request's rows in a packed forward of the batched core (`dflash.batch.attention.Segment`), shared by the
// fused attention over the pool (cpu_layer_ops.cpp) and the native decoder layers (decoder_stack.h).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace packed {

// Rows [start, start + count) of the packed sequence read the pool's slots `read_slots` (int64 [keys], in the
// request's own order) under `mask` (bool [count, keys], true = visible; none: every key visible).
struct Segment {
  int64_t start, count;
  torch::Tensor read_slots;
  c10::optional<torch::Tensor> mask;
};

}  // namespace packed
