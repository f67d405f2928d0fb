// The decoder layers of a Llama / Qwen3 model in one native call, for CPU forwards of a few rows (a decode step,
// a verification, a tree).
//
// On a CPU a one-token step of a small model spends as much time in the Python around its operations as in the
// operations: each layer makes about thirty torch and kernel calls through the interpreter. `DecoderStack` runs
// the same calls from C++: the same compiled functions of the other CPU extensions (the products of
// `int8_matmul.cpp`, `quant_matmul.cpp`, `amx_matmul.cpp`, the fused operations of `cpu_layer_ops.cpp`, reached
// through the function pointers those modules export as capsules) and the same torch operations (residual adds,
// the cache's copies, splits and views) on tensors of the same shapes and strides, in the order the Python layers
// call them. So every value is bitwise what the Python layers compute: speculative and plain decoding, native or
// not, give the same tokens.
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;

using Int8Matmul = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, bool, int64_t);
using BlockMatmul = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t);
using RmsNorm = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, double, bool);
using Rotary = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&);
using Attention = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                    const c10::optional<torch::Tensor>&, double);
using AttentionSlots = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                         const torch::Tensor&, const c10::optional<torch::Tensor>&, double);
using SiluMul = torch::Tensor (*)(const torch::Tensor&);

// The functions of the other extensions, set once by `bind` (null where that extension is not loaded).
struct Functions {
  Int8Matmul int8_matmul = nullptr;
  BlockMatmul float_matmul = nullptr;
  BlockMatmul amx_matmul = nullptr;
  RmsNorm rms_norm = nullptr;
  Rotary rotary = nullptr;
  Attention attention = nullptr;
  AttentionSlots attention_slots = nullptr;
  SiluMul silu_mul = nullptr;
};

Functions functions;

// Sets the pointer a capsule holds; None leaves it as it is (extensions are bound as models come to need them).
template <class Fn>
void set_from(Fn& slot, const py::object& capsule) {
  if (!capsule.is_none()) slot = reinterpret_cast<Fn>(capsule.cast<py::capsule>().get_pointer());
}

void bind(const py::object& int8_matmul, const py::object& float_matmul, const py::object& amx_matmul,
          const py::object& rms_norm, const py::object& rotary, const py::object& attention,
          const py::object& attention_slots, const py::object& silu_mul) {
  set_from(functions.int8_matmul, int8_matmul);
  set_from(functions.float_matmul, float_matmul);
  set_from(functions.amx_matmul, amx_matmul);
  set_from(functions.rms_norm, rms_norm);
  set_from(functions.rotary, rotary);
  set_from(functions.attention, attention);
  set_from(functions.attention_slots, attention_slots);
  set_from(functions.silu_mul, silu_mul);
}

// How one matrix is multiplied, as the Python modules do it.
enum Kind : int64_t {
  kDense = 0,    // nn.Linear: F.linear(x, weight, bias)
  kFloat32 = 1,  // QuantizedLinear on the float32 kernel
  kAmx = 2,      // QuantizedLinear on the AMX kernel
  kInt8 = 3,     // QuantizedLinear on the int8 kernel, one 8-bit part
  kInt8x2 = 4,   // QuantizedLinear on the int8 kernel, two 8-bit parts
};

struct Product {
  int64_t kind;
  torch::Tensor weights;  // kDense: float weight [out, in]; else GGUF blocks [out, bytes per row] uint8
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

torch::Tensor block_product(const Product& p, const torch::Tensor& rows) {
  switch (p.kind) {
    case kFloat32:
      TORCH_CHECK(functions.float_matmul != nullptr, "the float32 products kernel is not bound");
      return functions.float_matmul(rows, p.weights, p.qtype);
    case kAmx:
      TORCH_CHECK(functions.amx_matmul != nullptr, "the AMX products kernel is not bound");
      return functions.amx_matmul(rows, p.weights, p.qtype);
    case kInt8:
    case kInt8x2:
      TORCH_CHECK(functions.int8_matmul != nullptr, "the int8 products kernel is not bound");
      return functions.int8_matmul(rows, p.weights, p.qtype, true, p.kind == kInt8x2 ? 2 : 1);
    default:
      TORCH_CHECK(false, "unknown product kind ", p.kind);
  }
}

std::vector<int64_t> with_last(const torch::Tensor& x, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = last;
  return shape;
}

// QuantizedLinear.forward: rows = x.reshape(-1, in); y = product (+ bias); y.view(*lead, out)
torch::Tensor single_product(const Product& p, const c10::optional<torch::Tensor>& bias, const torch::Tensor& x,
                             int64_t in) {
  torch::Tensor y = block_product(p, x.reshape({-1, in}));
  if (bias.has_value()) y = y + *bias;
  return y.view(with_last(x, p.out));
}

torch::Tensor apply(const Linear& linear, const torch::Tensor& x) {
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

torch::Tensor normed(const Norm& norm, const torch::Tensor& x) {
  return functions.rms_norm(x, norm.weight, norm.eps, norm.adds_one);
}

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

// One request's rows in a packed forward of the batched core (`dflash.batch.attention.Segment`): rows
// [start, start + count) read the pool's slots `read_slots` under `mask` (bool [count, keys], or none).
struct Segment {
  int64_t start, count;
  torch::Tensor read_slots;
  c10::optional<torch::Tensor> mask;
};

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
    TORCH_CHECK(x.dim() == 3, "x must be [batch, seq, hidden]");
    const int64_t seq = x.size(1), end = length + seq;
    TORCH_CHECK(end <= keys.size(3), "the cache holds ", keys.size(3), " slots, not ", end);
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
    TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "x must be [1, rows, hidden]");
    TORCH_CHECK(functions.attention_slots != nullptr, "the fused layer operations are not bound");
    TORCH_CHECK(!segments.empty(), "a packed forward has a segment at least");
    return layers(x, cos, sin, capture, [&](const Layer& layer, const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v) {
      torch::Tensor keys = pool_keys.select(0, layer.index).narrow(0, 0, layer.kv_heads).narrow(2, 0, layer.head_dim);
      torch::Tensor values =
          pool_values.select(0, layer.index).narrow(0, 0, layer.kv_heads).narrow(2, 0, layer.head_dim);
      keys.index_copy_(1, write_slots, k.select(0, 0));
      values.index_copy_(1, write_slots, v.select(0, 0));
      std::vector<torch::Tensor> outputs;
      outputs.reserve(segments.size());
      for (const Segment& segment : segments) {
        const torch::Tensor rows = q.narrow(2, segment.start, segment.count).select(0, 0);  // [heads, n, head_dim]
        outputs.push_back(
            functions.attention_slots(rows, keys, values, segment.read_slots, segment.mask, layer.scale).unsqueeze(0));
      }
      return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
    });
  }

 private:
  // Every layer over x, `attend(layer, q, k, v)` storing the new K/V and attending -> [B, S, heads * head_dim].
  template <class Attend>
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> layers(torch::Tensor x, const torch::Tensor& cos,
                                                               const torch::Tensor& sin,
                                                               const std::vector<int64_t>& capture,
                                                               Attend&& attend) const {
    TORCH_CHECK(functions.rms_norm && functions.rotary && functions.attention && functions.silu_mul,
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

Product make_product(int64_t kind, torch::Tensor weights, int64_t qtype, int64_t out) {
  TORCH_CHECK(kind >= kDense && kind <= kInt8x2, "unknown product kind ", kind);
  return Product{kind, std::move(weights), qtype, out};
}

Linear make_linear(std::vector<Product> parts, c10::optional<torch::Tensor> bias, bool stacked, int64_t in) {
  TORCH_CHECK(!parts.empty(), "a linear layer needs a product");
  TORCH_CHECK(stacked || parts.size() == 1, "only a stack has several products");
  return Linear{std::move(parts), std::move(bias), stacked, in};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Llama / Qwen3 decoder layers in one native call, bitwise the Python layers' computation";
  module.def("bind", &bind, "the other CPU extensions' functions, as their capsules (None: left as bound before)",
             py::arg("int8_matmul"), py::arg("float_matmul"), py::arg("amx_matmul"), py::arg("rms_norm"),
             py::arg("rotary"), py::arg("attention"), py::arg("attention_slots"), py::arg("silu_mul"));
  py::class_<Product>(module, "Product")
      .def(py::init(&make_product), py::arg("kind"), py::arg("weights"), py::arg("qtype"), py::arg("out"));
  py::class_<Linear>(module, "Linear")
      .def(py::init(&make_linear), py::arg("parts"), py::arg("bias"), py::arg("stacked"), py::arg("in_features"));
  py::class_<Norm>(module, "Norm")
      .def(py::init([](torch::Tensor weight, double eps, bool adds_one) { return Norm{std::move(weight), eps, adds_one}; }),
           py::arg("weight"), py::arg("eps"), py::arg("adds_one"));
  py::class_<Layer>(module, "Layer")
      .def(py::init([](int64_t index, Norm input_norm, Norm post_norm, std::optional<Norm> q_norm,
                       std::optional<Norm> k_norm, Linear qkv, Linear o, Linear gate_up, Linear down, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, double scale) {
             return Layer{index, std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                          std::move(qkv), std::move(o), std::move(gate_up), std::move(down), heads, kv_heads,
                          head_dim, scale};
           }),
           py::arg("index"), py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("scale"));
  py::class_<Segment>(module, "Segment")
      .def(py::init([](int64_t start, int64_t count, torch::Tensor read_slots, c10::optional<torch::Tensor> mask) {
             return Segment{start, count, std::move(read_slots), std::move(mask)};
           }),
           py::arg("start"), py::arg("count"), py::arg("read_slots"), py::arg("mask"));
  py::class_<DecoderStack>(module, "DecoderStack")
      .def(py::init<std::vector<Layer>>(), py::arg("layers"))
      .def("__len__", &DecoderStack::size)
      .def("run", &DecoderStack::run, "the layers over x; (x, captured layer outputs)", py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("mask"), py::arg("keys"), py::arg("values"), py::arg("length"),
           py::arg("capture"), py::call_guard<py::gil_scoped_release>())
      .def("run_packed", &DecoderStack::run_packed, "the layers over packed rows into the batched pool",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("pool_keys"), py::arg("pool_values"),
           py::arg("write_slots"), py::arg("segments"), py::arg("capture"), py::call_guard<py::gil_scoped_release>());
}
