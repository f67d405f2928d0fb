// y[M, N] = x[M, K] @ W[N, K]^T with W stored as GGUF blocks (Q4_1 or Q8_0, see gguf_blocks.h) and x, y in
// float32.
//
// Batch invariance: every output y[m, n] is accumulated by one code path in one order whatever M is, how
// rows are grouped into register tiles, or how many threads run: per block, the 32 weights are
// dequantised (bit-identical to the reference `d * q + m`), multiplied lane-wise with x and added into a
// fixed set of vector accumulators; after the last block the accumulators are reduced in a fixed order.
// Row m of an M-row product is therefore bitwise equal to the product of that row alone. Contraction of
// separate multiplies and adds into FMAs is disabled at build time (-ffp-contract=off) so that the
// compiler cannot make that choice differently in different tile shapes; FMAs used here are explicit.
//
// ISA: that of gguf_blocks.h (AVX-512F, else AVX2 + FMA + F16C, else portable C++; -march=native).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "gguf_blocks.h"

namespace {

// ---------------------------------------------------------------------------------------------------------
// Accumulator tiles: ROWS output rows x COLS input rows, cleared before and reduced into y ([COLS, n]) after.
// ---------------------------------------------------------------------------------------------------------
template <int ROWS, int COLS>
inline void zero_all(Accumulator (&acc)[ROWS][COLS]) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c) zero(acc[r][c]);
  }
}

template <int ROWS, int COLS>
inline void store_sums(Accumulator (&acc)[ROWS][COLS], float* y, int64_t n) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c) y[c * n + r] = reduce(acc[r][c]);
  }
}

// ---------------------------------------------------------------------------------------------------------
// One input row: register tile of ROWS output rows x COLS input rows, all blocks of K.
// ---------------------------------------------------------------------------------------------------------
template <class Format, int ROWS, int COLS>
void tile(const uint8_t* weights, int64_t row_bytes, int64_t blocks, const float* x, int64_t k, float* y,
          int64_t n) {
  // weights: ROWS rows of row_bytes; x: COLS rows of k floats; y: COLS rows of n floats (column 0 = first row)
  Accumulator acc[ROWS][COLS];
  zero_all(acc);
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const Weights w = Format::dequant(weights + r * row_bytes + b * Format::kBytes);
#pragma GCC unroll 8
      for (int c = 0; c < COLS; ++c) accumulate(acc[r][c], w, x + c * k + b * kBlockValues);
    }
  }
  store_sums(acc, y, n);
}

// ---------------------------------------------------------------------------------------------------------
// Several input rows: panels of dequantised weights.
// A panel of PANEL_ROWS output rows is dequantised once (all of K, into a scratch buffer that stays in L1/L2)
// and then multiplied with every input row, INPUTS input rows at a time, one lane group (part) at a time so
// that only the accumulators, one part of each panel row and one part of one input row are live in registers.
// Every accumulator sees the same operations in the same order as in `tile`, so results are bitwise those of
// the one-row path.
// ---------------------------------------------------------------------------------------------------------
template <int PANEL_ROWS, int INPUTS>
void panel_tile(const float* panel, int64_t blocks, const float* x, int64_t k, float* y, int64_t n) {
  // panel: PANEL_ROWS rows of k dequantised weights; x: INPUTS rows of k floats; y: INPUTS rows of n floats
  Accumulator acc[PANEL_ROWS][INPUTS];
  zero_all(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t offset = b * kBlockValues;
#pragma GCC unroll 8
    for (int part = 0; part < kParts; ++part) {
      Part w[PANEL_ROWS];
#pragma GCC unroll 8
      for (int r = 0; r < PANEL_ROWS; ++r) w[r] = load_part(panel + r * k + offset + part * kPartWidth);
#pragma GCC unroll 8
      for (int c = 0; c < INPUTS; ++c) {
        const Part xs = load_part(x + c * k + offset + part * kPartWidth);
#pragma GCC unroll 8
        for (int r = 0; r < PANEL_ROWS; ++r) accumulate_part(acc[r][c], part, w[r], xs);
      }
    }
  }
  store_sums(acc, y, n);
}

// All input rows against one dequantised panel: tiles of INPUTS rows, then one smaller tile for the rest.
template <int PANEL_ROWS, int INPUTS>
void panel_times_inputs(const float* panel, int64_t blocks, const float* x, int64_t m, int64_t k, float* y,
                        int64_t n) {
  int64_t c = 0;
  for (; c + INPUTS <= m; c += INPUTS) panel_tile<PANEL_ROWS, INPUTS>(panel, blocks, x + c * k, k, y + c * n, n);
  if constexpr (INPUTS > 1) {
    if (c < m) panel_times_inputs<PANEL_ROWS, INPUTS - 1>(panel, blocks, x + c * k, m - c, k, y + c * n, n);
  }
}

template <class Format>
void dequantize_rows(const uint8_t* weights, int64_t row_bytes, int64_t blocks, int64_t rows, float* out) {
  const int64_t k = blocks * kBlockValues;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      store(Format::dequant(weights + r * row_bytes + b * Format::kBytes), out + r * k + b * kBlockValues);
    }
  }
}

// Tile shapes; they change speed only, never results.
constexpr int SINGLE_ROWS = 4;  // one input row: output rows per tile (2 * SINGLE_ROWS accumulator chains)
constexpr int PANEL_ROWS = 2;   // several input rows: output rows dequantised per panel
constexpr int PANEL_INPUTS = 3;  // input rows per register tile against a panel
constexpr int64_t INPUT_GROUP = 64;  // input rows that every panel meets before the next group's turn

template <class Format>
void matmul_rows(const uint8_t* weights, int64_t row_bytes, int64_t blocks, const float* x, int64_t m, int64_t k,
                 float* y, int64_t n, int64_t row_begin, int64_t row_end) {
  int64_t row = row_begin;
  if (m == 1) {
    for (; row + SINGLE_ROWS <= row_end; row += SINGLE_ROWS) {
      tile<Format, SINGLE_ROWS, 1>(weights + row * row_bytes, row_bytes, blocks, x, k, y + row, n);
    }
    for (; row < row_end; ++row) tile<Format, 1, 1>(weights + row * row_bytes, row_bytes, blocks, x, k, y + row, n);
    return;
  }
  // Input rows in groups of INPUT_GROUP, so that a group stays in L2 while every panel passes over it (each
  // group dequantises the panels again: a small cost next to INPUT_GROUP rows of products).
  std::vector<float> panel(static_cast<size_t>(PANEL_ROWS * k));
  for (int64_t first = 0; first < m; first += INPUT_GROUP) {
    const int64_t rows = std::min<int64_t>(INPUT_GROUP, m - first);
    const float* group = x + first * k;
    float* out = y + first * n;
    row = row_begin;
    for (; row + PANEL_ROWS <= row_end; row += PANEL_ROWS) {
      dequantize_rows<Format>(weights + row * row_bytes, row_bytes, blocks, PANEL_ROWS, panel.data());
      panel_times_inputs<PANEL_ROWS, PANEL_INPUTS>(panel.data(), blocks, group, rows, k, out + row, n);
    }
    for (; row < row_end; ++row) {
      dequantize_rows<Format>(weights + row * row_bytes, row_bytes, blocks, 1, panel.data());
      panel_times_inputs<1, PANEL_INPUTS>(panel.data(), blocks, group, rows, k, out + row, n);
    }
  }
}


// Output rows handed to one task at least (so small matrices are not split into tiny pieces).
constexpr int64_t kMinRowsPerTask = 16;

}  // namespace

torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype) {
  // x: [M, K] float32; blocks: [N, K / 32 * block bytes] uint8 -> y: [M, N] float32
  const auto [input, out] = product_operands(x, blocks, qtype);
  const int64_t m = input.size(0), k = input.size(1), n = blocks.size(0);
  if (m == 0 || n == 0) return out;
  const uint8_t* weights = blocks.data_ptr<uint8_t>();
  const float* xs = input.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), n_blocks = k / kBlockValues;
  at::parallel_for(0, n, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    if (qtype == kTypeQ4_1) {
      matmul_rows<Q4_1>(weights, row_bytes, n_blocks, xs, m, k, ys, n, begin, end);
    } else {
      matmul_rows<Q8_0>(weights, row_bytes, n_blocks, xs, m, k, ys, n, begin, end);
    }
  });
  return out;
}

torch::Tensor dequantize(const torch::Tensor& blocks, int64_t qtype, int64_t k) {
  // blocks: [R, K / 32 * block bytes] uint8 -> [R, K] float32, bit-identical to the reference formulas
  check_blocks(blocks, qtype, k);
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1), n_blocks = k / kBlockValues;
  const int64_t bytes = block_bytes(qtype);
  torch::Tensor out = torch::empty({rows, k}, torch::TensorOptions().dtype(torch::kFloat32));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t* block = src + r * row_bytes + b * bytes;
        const Weights w = qtype == kTypeQ4_1 ? Q4_1::dequant(block) : Q8_0::dequant(block);
        store(w, dst + r * k + b * kBlockValues);
      }
    }
  });
  return out;
}

std::string isa() { return kIsa; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.doc() = "Matrix products with GGUF Q4_1 / Q8_0 weights and float32 activations (batch invariant)";
  module.def("matmul", &quant_matmul, "y[M, N] = x[M, K] @ dequant(blocks)[N, K]^T", py::arg("x"),
             py::arg("blocks"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  module.def("dequantize", &dequantize, "blocks [R, bytes] -> float32 [R, K]", py::arg("blocks"),
             py::arg("qtype"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
  module.def("isa", &isa, "the instruction set this build uses: avx512, avx2 or generic");
  // for the native decoder layers (cpu_decoder.cpp), which call this very function
  module.attr("matmul_capsule") = py::capsule(reinterpret_cast<void*>(&quant_matmul), "dflash.quant_matmul");
}
