// Python bindings of the native layers: a Llama / Qwen3 target's decoder layers (`decoder_stack.h`) and a DFlash
// drafter's layers (`drafter_stack.h`), each in one native call, for CPU forwards of a few rows (a decode step, a
// verification, a tree, a drafter round).
//
// On a CPU a one-token step of a small model spends as much time in the Python around its operations as in the
// operations: each layer makes about thirty torch and kernel calls through the interpreter. The stacks run the
// same calls from C++: the same compiled functions of the other CPU extensions (the products of `int8_matmul.cpp`,
// `quant_matmul.cpp`, `amx_matmul.cpp`, the fused operations of `cpu_layer_ops.cpp`, reached through the function
// pointers those modules export as capsules, `native_layers.h`) and the same torch operations (residual adds, the
// cache's copies, splits and views) on tensors of the same shapes and strides, in the order the Python layers call
// them. So every value is bitwise what the Python layers compute: speculative and plain decoding, native or not,
// give the same tokens.
#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

#include "decoder_stack.h"
#include "drafter_stack.h"
#include "native_layers.h"

using namespace native_layers;  // NOLINT: the module binds this namespace's types

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Llama / Qwen3 decoder layers and DFlash drafter layers in one native call, bitwise the Python "
                 "layers' computation";
  module.def("bind", &bind, "the other CPU extensions' functions, as their capsules (None: left as bound before)",
             py::arg("int8_matmul"), py::arg("float_matmul"), py::arg("amx_matmul"), py::arg("rms_norm"),
             py::arg("rotary"), py::arg("attention"), py::arg("attention_segments"), py::arg("silu_mul"),
             py::arg("panel_matmul") = py::none());
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
  py::class_<DrafterLayer>(module, "DrafterLayer")
      .def(py::init([](int64_t index, Norm input_norm, Norm post_norm, Norm q_norm, Norm k_norm, Linear qkv, Linear kv,
                       Linear o, Linear gate_up, Linear down, int64_t heads, int64_t kv_heads, int64_t head_dim) {
             return DrafterLayer{index, std::move(input_norm), std::move(post_norm), std::move(q_norm),
                                 std::move(k_norm), std::move(qkv), std::move(kv), std::move(o), std::move(gate_up),
                                 std::move(down), heads, kv_heads, head_dim};
           }),
           py::arg("index"), py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qkv"), py::arg("kv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"));
  py::class_<DrafterStack>(module, "DrafterStack")
      .def(py::init<std::vector<DrafterLayer>>(), py::arg("layers"))
      .def("__len__", &DrafterStack::size)
      .def("absorb", &DrafterStack::absorb, "every layer's keys and values of context rows into the cache",
           py::arg("ctx"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("length"),
           py::call_guard<py::gil_scoped_release>())
      .def("block", &DrafterStack::block, "the layers over a block after the cached context", py::arg("x"),
           py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("first"), py::arg("length"),
           py::arg("q_start"), py::arg("q_stop"), py::call_guard<py::gil_scoped_release>());
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
