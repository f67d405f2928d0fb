// What the native layers share (`cpu_decoder.cpp`): the other CPU extensions' functions, reached through the
// capsules those extensions export (bound once), and projections and norms computed exactly as the Python modules
// compute them (nn.Linear, QuantizedLinear, QuantizedStack, RMSNorm through the fused kernel).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "kernel_checks.h"
#include "packed_segments.h"

namespace native_layers {

namespace py = pybind11;

using Int8Matmul = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, bool, int64_t);
using PanelMatmul = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, int64_t);
using BlockMatmul = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t);
using RmsNorm = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, double, bool);
using Rotary = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&);
using Attention = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                    const c10::optional<torch::Tensor>&, double);
using AttentionSegments = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                            const std::vector<packed::Segment>&, double);
using SiluMul = torch::Tensor (*)(const torch::Tensor&);

// The functions of the other extensions, set once by `bind` (null where that extension is not loaded).
struct Functions {
  Int8Matmul int8_matmul = nullptr;
  PanelMatmul panel_matmul = nullptr;
  BlockMatmul float_matmul = nullptr;
  BlockMatmul amx_matmul = nullptr;
  RmsNorm rms_norm = nullptr;
  Rotary rotary = nullptr;
  Attention attention = nullptr;
  AttentionSegments attention_segments = nullptr;
  SiluMul silu_mul = nullptr;
};

inline Functions functions;

// Sets the pointer a capsule holds; None leaves it as it is (extensions are bound as models come to need them).
template <class Fn>
inline void set_from(Fn& slot, const py::object& capsule) {
  if (!capsule.is_none()) slot = reinterpret_cast<Fn>(capsule.cast<py::capsule>().get_pointer());
}

inline void bind(const py::object& int8_matmul, const py::object& float_matmul, const py::object& amx_matmul,
          const py::object& rms_norm, const py::object& rotary, const py::object& attention,
          const py::object& attention_segments, const py::object& silu_mul, const py::object& panel_matmul) {
  set_from(functions.int8_matmul, int8_matmul);
  set_from(functions.panel_matmul, panel_matmul);
  set_from(functions.float_matmul, float_matmul);
  set_from(functions.amx_matmul, amx_matmul);
  set_from(functions.rms_norm, rms_norm);
  set_from(functions.rotary, rotary);
  set_from(functions.attention, attention);
  set_from(functions.attention_segments, attention_segments);
  set_from(functions.silu_mul, silu_mul);
}

// How one matrix is multiplied, as the Python modules do it.
enum Kind : int64_t {
  kDense = 0,    // nn.Linear: F.linear(x, weight, bias)
  kFloat32 = 1,  // QuantizedLinear on the float32 kernel
  kAmx = 2,      // QuantizedLinear on the AMX kernel
  kInt8 = 3,     // QuantizedLinear on the int8 kernel, one 8-bit part
  kInt8x2 = 4,   // QuantizedLinear on the int8 kernel, two 8-bit parts
  kPanels = 5,   // QuantizedLinear on the int8 kernel, weight panels (int8_panels.h), one 8-bit part
  kPanelsx2 = 6, // the same, two 8-bit parts
};

struct Product {
  int64_t kind;
  torch::Tensor weights;  // kDense: float weight [out, in]; kPanels*: weight panels; else GGUF blocks [out, bytes]
  int64_t qtype;
  int64_t out;
};

// nn.Linear, QuantizedLinear (one product) or QuantizedStack (several, side by side).
struct Linear {
  std::vector<Product> parts;
  c10::optional<torch::Tensor> bias;
  bool stacked;
  int64_t in;
};

inline torch::Tensor block_product(const Product& p, const torch::Tensor& rows) {
  switch (p.kind) {
    case kFloat32:
      DFLASH_CHECK(functions.float_matmul != nullptr, "the float32 products kernel is not bound");
      return functions.float_matmul(rows, p.weights, p.qtype);
    case kAmx:
      DFLASH_CHECK(functions.amx_matmul != nullptr, "the AMX products kernel is not bound");
      return functions.amx_matmul(rows, p.weights, p.qtype);
    case kInt8:
    case kInt8x2:
      DFLASH_CHECK(functions.int8_matmul != nullptr, "the int8 products kernel is not bound");
      return functions.int8_matmul(rows, p.weights, p.qtype, true, p.kind == kInt8x2 ? 2 : 1);
    case kPanels:
    case kPanelsx2:
      DFLASH_CHECK(functions.panel_matmul != nullptr, "the int8 panel products are not bound");
      return functions.panel_matmul(rows, p.weights, p.qtype, p.out, p.kind == kPanelsx2 ? 2 : 1);
    default:
      ::kernel_checks::refuse("unknown product kind ", p.kind);
  }
}

inline std::vector<int64_t> with_last(const torch::Tensor& x, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = last;
  return shape;
}

// QuantizedLinear.forward: rows = x.reshape(-1, in); y = product (+ bias); y.view(*lead, out)
inline torch::Tensor single_product(const Product& p, const c10::optional<torch::Tensor>& bias, const torch::Tensor& x,
                             int64_t in) {
  torch::Tensor y = block_product(p, x.reshape({-1, in}));
  if (bias.has_value()) y = y + *bias;
  return y.view(with_last(x, p.out));
}

inline torch::Tensor apply(const Linear& linear, const torch::Tensor& x) {
  if (linear.parts.size() == 1 && linear.parts[0].kind == kDense) {
    return at::linear(x, linear.parts[0].weights, linear.bias);
  }
  if (!linear.stacked) return single_product(linear.parts[0], linear.bias, x, linear.in);
  // QuantizedStack.forward: cat of its parts' outputs (each a QuantizedLinear without bias), then the bias
  std::vector<torch::Tensor> outputs;
  outputs.reserve(linear.parts.size());
  for (const Product& part : linear.parts) outputs.push_back(single_product(part, c10::nullopt, x, linear.in));
  torch::Tensor y = at::cat(outputs, -1);
  return linear.bias.has_value() ? y + *linear.bias : y;
}

struct Norm {
  torch::Tensor weight;
  double eps;
  bool adds_one;
};

inline torch::Tensor normed(const Norm& norm, const torch::Tensor& x) {
  return functions.rms_norm(x, norm.weight, norm.eps, norm.adds_one);
}

inline Product make_product(int64_t kind, torch::Tensor weights, int64_t qtype, int64_t out) {
  DFLASH_CHECK(kind >= kDense && kind <= kPanelsx2, "unknown product kind ", kind);
  return Product{kind, std::move(weights), qtype, out};
}

inline Linear make_linear(std::vector<Product> parts, c10::optional<torch::Tensor> bias, bool stacked, int64_t in) {
  DFLASH_CHECK(!parts.empty(), "a linear layer needs a product");
  DFLASH_CHECK(stacked || parts.size() == 1, "only a stack has several products");
  return Linear{std::move(parts), std::move(bias), stacked, in};
}

}  // namespace native_layers
