// y[M, N] = x[M, K] @ W[N, K]^T with W stored as GGUF blocks (Q4_1 or Q8_0, see gguf_blocks.h), computed on
// the CPU's AMX tiles: the products take bfloat16-rounded inputs (each weight dequantised to float32 exactly as
// the reference `d * q + m`, then rounded to bf16; each x value rounded to bf16) and are summed in float32.
//
// Why: one tile product multiplies 16 weight rows by up to 16 input rows over 32 values, so a verification of
// up to 16 rows costs about what one row costs; the time goes to dequantising the weights, once per call. The
// float32 kernel (quant_matmul.cpp) pays its multiply-adds per input row instead.
//
// Batch invariance: every output y[m, n] comes from one tile accumulator element that adds the chunk products
// of its own weight row and input row over K in a fixed order (chunk 0, 1, ...), whatever M is, where the row
// sits in its group of 16, or how many threads run (tiles are independent per element). Row m of an M-row
// product is therefore bitwise equal to the product of that row alone.
//
// Tiles: C0..C5 = sums for up to 6 groups of 16 input rows, A (tile 6) = 16 weight rows x 32 values (bf16),
// B (tile 7) = 32 values x 16 input rows in the pair layout TDPBF16PS reads. Every tile is 16 rows x 64 bytes;
// rows past the end of W or x are zeros.
//
// Availability: compiled only where the compiler targets AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on
// such a CPU); at run time Linux must grant the process the tile state (arch_prctl). `available()` says both.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gguf_blocks.h"
#include "kernel_checks.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__linux__)
#define DFLASH_AMX 1
// Tile registers of the weights (A) and the inputs (B); the intrinsics paste the number into the register name.
#define DFLASH_TILE_A 6
#define DFLASH_TILE_B 7
#include "amx_tiles.h"
#endif

namespace {

#if defined(DFLASH_AMX)
constexpr int kTileRows = 16;                       // weight rows per A tile, input rows per group
constexpr int kTileBytes = 64;                      // bytes per tile row
constexpr int kTileElements = kTileRows * kTileBytes / 2;  // bf16 values per tile (512)
constexpr int kMaxGroups = 6;                       // accumulator tiles C0..C5
constexpr int64_t kMinTilesPerTask = 2;             // weight tiles (16 rows each) handed to one task at least

using dflash_amx::TileConfig;
using dflash_amx::tile_state_granted;

void configure_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = kTileBytes;
  }
  dflash_amx::load_tile_config(config);
}

// One block of 32 weights -> their 32 bf16 values at `out` (64 bytes), each the bf16 of the float32 reference
// value (`d * q + m` for Q4_1, `d * q` for Q8_0).
struct Q4_1Tiles {
  static constexpr int64_t kBytes = Q4_1::kBytes;
  // The 16 possible values of the block, bf16(d * q + m) for q = 0..15, looked up by nibble (vpermw).
  static inline void to_bf16(const uint8_t* block, uint16_t* out) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 d = _mm512_set1_ps(half_to_float(load_u16(block)));
    const __m512 m = _mm512_set1_ps(half_to_float(load_u16(block + 2)));
    const __m256bh values = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_mul_ps(d, levels), m));
    const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(values));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));  // weights 0..15
    const __m256i high = _mm256_srli_epi16(bytes, 4);                       // weights 16..31
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    _mm512_store_si512(out, _mm512_permutexvar_epi16(index, table));
  }
};

struct Q8_0Tiles {
  static constexpr int64_t kBytes = Q8_0::kBytes;
  static inline void to_bf16(const uint8_t* block, uint16_t* out) {
    const Weights w = Q8_0::dequant(block);
    _mm512_store_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w.hi, w.lo)));
  }
};

// The A tile of chunk c: `rows` (<= 16) weight rows, values 32 c .. 32 c + 31, as tile[r * 32 + j]; rows past
// `rows` must already be zeros.
template <class Format>
inline void fill_tile(const uint8_t* weights, int64_t row_bytes, int64_t c, int rows, uint16_t* tile) {
  for (int r = 0; r < rows; ++r) Format::to_bf16(weights + r * row_bytes + c * Format::kBytes, tile + r * 32);
}

// Asks for the cache line of chunk c in each of the 16 rows at `weights` (the next weight tile): sixteen
// interleaved row streams are more than the hardware prefetcher follows.
template <class Format>
inline void prefetch_chunk(const uint8_t* weights, int64_t row_bytes, int64_t c) {
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(weights + r * row_bytes + c * Format::kBytes), _MM_HINT_T0);
  }
}

// Input tiles: for group g (input rows 16 g .. 16 g + 15) and chunk c, the B tile in the pair layout:
// tiles[(g * chunks + c) * 512 + p * 32 + 2 * i + j] = bf16(x[16 g + i, 32 c + 2 p + j]); missing rows are zeros.
std::vector<uint16_t> input_tiles(const float* x, int64_t m, int64_t k) {
  const int64_t chunks = k / kBlockValues, groups = (m + kTileRows - 1) / kTileRows;
  std::vector<uint16_t> tiles(static_cast<size_t>(groups * chunks * kTileElements), 0);
  std::vector<uint16_t> row(static_cast<size_t>(k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t v = 0; v < k; v += 16) {  // k is a multiple of 32
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * k + v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row.data() + v), reinterpret_cast<__m256i>(half));
    }
    const int64_t g = i / kTileRows, slot = i % kTileRows;
    uint32_t* pairs = reinterpret_cast<uint32_t*>(row.data());  // pair p of chunk c = pairs[16 c + p]
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(tiles.data() + (g * chunks + c) * kTileElements);
      for (int p = 0; p < 16; ++p) tile[p * kTileRows + slot] = pairs[16 * c + p];
    }
  }
  return tiles;
}

// Sums of 16 weight rows with GROUPS groups of input tiles, written into y (rows of n floats). The A tile of
// chunk c is `panel + 512 c` (filled before) or, with `weights` given, dequantised here into one of two
// alternating buffers in `panel` (so the tile load never waits on the stores of the tile before).
template <class Format, int GROUPS>
void weights_times_groups(const uint8_t* weights, int64_t row_bytes, uint16_t* panel, const uint16_t* tiles,
                          int64_t chunks, int64_t first_group, int64_t m, int rows, float* y, int64_t n) {
  if constexpr (GROUPS >= 1) _tile_zero(0);
  if constexpr (GROUPS >= 2) _tile_zero(1);
  if constexpr (GROUPS >= 3) _tile_zero(2);
  if constexpr (GROUPS >= 4) _tile_zero(3);
  if constexpr (GROUPS >= 5) _tile_zero(4);
  if constexpr (GROUPS >= 6) _tile_zero(5);
  const auto b_tile = [&](int64_t group, int64_t chunk) {
    return tiles + ((first_group + group) * chunks + chunk) * kTileElements;
  };
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* a_tile = panel + c * kTileElements;
    if (weights != nullptr) {
      uint16_t* buffer = panel + (c % 2) * kTileElements;
      if (rows == kTileRows && (c * Format::kBytes) % 64 < Format::kBytes) {
        prefetch_chunk<Format>(weights + kTileRows * row_bytes, row_bytes, c);  // past the end: harmless hint
      }
      fill_tile<Format>(weights, row_bytes, c, rows, buffer);
      a_tile = buffer;
    }
    _tile_loadd(DFLASH_TILE_A, a_tile, kTileBytes);
    _tile_loadd(DFLASH_TILE_B, b_tile(0, c), kTileBytes);
    _tile_dpbf16ps(0, DFLASH_TILE_A, DFLASH_TILE_B);
    if constexpr (GROUPS >= 2) {
      _tile_loadd(DFLASH_TILE_B, b_tile(1, c), kTileBytes);
      _tile_dpbf16ps(1, DFLASH_TILE_A, DFLASH_TILE_B);
    }
    if constexpr (GROUPS >= 3) {
      _tile_loadd(DFLASH_TILE_B, b_tile(2, c), kTileBytes);
      _tile_dpbf16ps(2, DFLASH_TILE_A, DFLASH_TILE_B);
    }
    if constexpr (GROUPS >= 4) {
      _tile_loadd(DFLASH_TILE_B, b_tile(3, c), kTileBytes);
      _tile_dpbf16ps(3, DFLASH_TILE_A, DFLASH_TILE_B);
    }
    if constexpr (GROUPS >= 5) {
      _tile_loadd(DFLASH_TILE_B, b_tile(4, c), kTileBytes);
      _tile_dpbf16ps(4, DFLASH_TILE_A, DFLASH_TILE_B);
    }
    if constexpr (GROUPS >= 6) {
      _tile_loadd(DFLASH_TILE_B, b_tile(5, c), kTileBytes);
      _tile_dpbf16ps(5, DFLASH_TILE_A, DFLASH_TILE_B);
    }
  }
  alignas(64) float sums[kMaxGroups][kTileRows * kTileRows];  // sums[g][r * 16 + i]: weight row r, input i
  _tile_stored(0, sums[0], kTileBytes);
  if constexpr (GROUPS >= 2) _tile_stored(1, sums[1], kTileBytes);
  if constexpr (GROUPS >= 3) _tile_stored(2, sums[2], kTileBytes);
  if constexpr (GROUPS >= 4) _tile_stored(3, sums[3], kTileBytes);
  if constexpr (GROUPS >= 5) _tile_stored(4, sums[4], kTileBytes);
  if constexpr (GROUPS >= 6) _tile_stored(5, sums[5], kTileBytes);
  // Column i of a sums tile is input i's 16 outputs: one gather each, stored as the `rows` outputs of y's row.
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kTileRows));
  const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1u);
  for (int g = 0; g < GROUPS; ++g) {
    const int64_t base = (first_group + g) * kTileRows;
    const int64_t inputs = std::min<int64_t>(kTileRows, m - base);
    for (int64_t i = 0; i < inputs; ++i) {
      _mm512_mask_storeu_ps(y + (base + i) * n, valid, _mm512_i32gather_ps(column, sums[g] + i, 4));
    }
  }
}

// All input groups against 16 weight rows. Up to 6 groups (96 input rows: decoding steps, verifications,
// drafter rounds) share one pass that dequantises each chunk as it goes; more (prefill) dequantise the rows'
// whole panel once and pass over it per 6 groups.
template <class Format>
void weights_times_all(const uint8_t* weights, int64_t row_bytes, uint16_t* panel, const uint16_t* tiles,
                       int64_t chunks, int64_t m, int rows, float* y, int64_t n) {
  const int64_t groups = (m + kTileRows - 1) / kTileRows;
  const uint8_t* streamed = weights;
  if (groups > kMaxGroups) {
    for (int64_t c = 0; c < chunks; ++c) fill_tile<Format>(weights, row_bytes, c, rows, panel + c * kTileElements);
    streamed = nullptr;
  }
  for (int64_t g = 0; g < groups; g += kMaxGroups) {
    const auto args = std::make_tuple(streamed, row_bytes, panel, tiles, chunks, g, m, rows, y, n);
    switch (std::min<int64_t>(kMaxGroups, groups - g)) {
      case 1: std::apply(weights_times_groups<Format, 1>, args); break;
      case 2: std::apply(weights_times_groups<Format, 2>, args); break;
      case 3: std::apply(weights_times_groups<Format, 3>, args); break;
      case 4: std::apply(weights_times_groups<Format, 4>, args); break;
      case 5: std::apply(weights_times_groups<Format, 5>, args); break;
      default: std::apply(weights_times_groups<Format, 6>, args); break;
    }
  }
}

template <class Format>
void matmul_tiles(const uint8_t* weights, int64_t row_bytes, int64_t n, int64_t k, const uint16_t* tiles,
                  int64_t m, float* y, int64_t tile_begin, int64_t tile_end) {
  const int64_t chunks = k / kBlockValues;
  configure_tiles();
  // Panel storage, 64-byte aligned, zeros (rows past the end of W stay zeros: only `rows` rows are written):
  // two tiles where the chunks are dequantised as they go, the whole panel otherwise.
  const int64_t panel_tiles = (m + kTileRows - 1) / kTileRows > kMaxGroups ? chunks : 2;
  std::vector<uint16_t> storage(static_cast<size_t>(panel_tiles * kTileElements + 32), 0);
  uint16_t* panel = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t first_row = t * kTileRows;
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n - first_row));
    weights_times_all<Format>(weights + first_row * row_bytes, row_bytes, panel, tiles, chunks, m, rows,
                              y + first_row, n);
  }
  _tile_release();
}
#endif  // DFLASH_AMX

}  // namespace

bool available() {
#if defined(DFLASH_AMX)
  return tile_state_granted();
#else
  return false;
#endif
}

torch::Tensor amx_matmul(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype) {
  // x: [M, K] float32; blocks: [N, K / 32 * block bytes] uint8 -> y: [M, N] float32
  DFLASH_CHECK(available(), "AMX tile products are not available on this CPU or build");
  const auto [input, out] = product_operands(x, blocks, qtype);
  const int64_t m = input.size(0), k = input.size(1), n = blocks.size(0);
  if (m == 0 || n == 0) return out;
#if defined(DFLASH_AMX)
  const std::vector<uint16_t> tiles = input_tiles(input.data_ptr<float>(), m, k);
  const uint8_t* weights = blocks.data_ptr<uint8_t>();
  float* ys = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), weight_tiles = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, weight_tiles, kMinTilesPerTask, [&](int64_t begin, int64_t end) {
    if (qtype == kTypeQ4_1) {
      matmul_tiles<Q4_1Tiles>(weights, row_bytes, n, k, tiles.data(), m, ys, begin, end);
    } else {
      matmul_tiles<Q8_0Tiles>(weights, row_bytes, n, k, tiles.data(), m, ys, begin, end);
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.doc() = "Matrix products with GGUF Q4_1 / Q8_0 weights on AMX tiles (bf16 products, float32 sums, batch invariant)";
  module.def("matmul", &amx_matmul, "y[M, N] = bf16(x)[M, K] @ bf16(dequant(blocks))[N, K]^T, float32 sums",
             py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  module.def("available", &available, "whether this build has AMX and the process may use the tile state");
  // for the native decoder layers (cpu_decoder.cpp), which call this very function
  module.attr("matmul_capsule") = py::capsule(reinterpret_cast<void*>(&amx_matmul), "dflash.amx_matmul");
}
