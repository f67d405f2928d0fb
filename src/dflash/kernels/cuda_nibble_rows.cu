// Products of 1 to 8 input rows with 4-bit GGUF matrices kept as words (`gguf_nibbles.py`: Q4_0, Q4_1, Q4_K and
// Q6_K), by integer dot products: the CUDA form of `triton_gguf_int8_programs.nibble_matmul_kernel` /
// `six_bit_matmul_kernel` for decoding steps, where the products must stream the weights near the memory's speed.
//
// Each warp owns two weight rows; its lanes take the rows' groups of 32 values in turn (lane l: groups l, l + 32,
// ...), UNROLL groups a step with every load of the step issued before any arithmetic, so that enough bytes are in
// flight: a group is one 16-byte load of its 4 words (byte t of word u: value 4u + t low, 16 + 4u + t high), its
// scales beside. Each input row's 8-bit parts (`QuantizedInput`) meet a word in 2 `dp4a`s a part: the low nibbles
// masked, the high ones masked in place (16x their values, unsigned bytes) with their sum divided by 16 once; Q6_K
// joins its top bits first. One integer sum per group (Q6_K: per 16 values), exact; the float side per group is the
// Triton program's,
//   acc += (scale_w dx) isum + min_w sx        (Q6_K: acc += scale_w,h (dx isum_h - 32 sx_h) per half h),
// then the 32 lanes' sums are added in a fixed tree. Every input row runs the same steps whatever the number of
// rows (the float operations rounded one by one, never contracted), so a row's result does not depend on the rows
// beside it; one row has a program of its own, which computes the same.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace {

// The tiling (benchmarks/gpu_nibble_rows.py builds other values with -D to compare them).
#ifndef DFLASH_ROWS_PER_WARP
#define DFLASH_ROWS_PER_WARP 2
#endif
#ifndef DFLASH_UNROLL
#define DFLASH_UNROLL 4
#endif
// Blocks an SM must be able to hold: 4 caps a thread at 128 registers, where the compiler would otherwise take up to
// 168 (Q6_K) and leave too few warps to cover the loads' latency.
#ifndef DFLASH_MIN_BLOCKS
#define DFLASH_MIN_BLOCKS 4
#endif
constexpr int kWarps = 4;                          // warps per block
constexpr int kRowsPerWarp = DFLASH_ROWS_PER_WARP;  // weight rows per warp
constexpr int kUnroll = DFLASH_UNROLL;              // groups per lane per step
constexpr unsigned kNibbles = 0x0F0F0F0Fu;

enum Format : int { kQ4_0 = 0, kQ4_1 = 1, kQ4_K = 2, kQ6_K = 3 };

template <typename T>
__device__ inline void store_value(T* at, float v);
template <>
__device__ inline void store_value<float>(float* at, float v) { *at = v; }
template <>
__device__ inline void store_value<__nv_bfloat16>(__nv_bfloat16* at, float v) { *at = __float2bfloat16(v); }
template <>
__device__ inline void store_value<__half>(__half* at, float v) { *at = __float2half(v); }

// 16 bytes that are read once: no L1 allocation (the weights are streamed; the inputs stay in L1).
__device__ inline int4 stream_load(const int4* at) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(at));
  return v;
}

// A group's integer sums against one part of one input row: the first 16 values' and the second 16's.
// first[u] / second[u]: word u's values 4u..4u+3 and 16+4u..16+4u+3 as bytes; x0, x1: the input's values 0..15
// and 16..31.
__device__ inline void group_dots(const unsigned (&first)[4], const unsigned (&second)[4], const int4& x0,
                                  const int4& x1, int& sum_first, int& sum_second) {
  sum_first = __dp4a(static_cast<int>(first[0]), x0.x, 0);
  sum_first = __dp4a(static_cast<int>(first[1]), x0.y, sum_first);
  sum_first = __dp4a(static_cast<int>(first[2]), x0.z, sum_first);
  sum_first = __dp4a(static_cast<int>(first[3]), x0.w, sum_first);
  sum_second = __dp4a(static_cast<int>(second[0]), x1.x, 0);
  sum_second = __dp4a(static_cast<int>(second[1]), x1.y, sum_second);
  sum_second = __dp4a(static_cast<int>(second[2]), x1.z, sum_second);
  sum_second = __dp4a(static_cast<int>(second[3]), x1.w, sum_second);
}

// A weight row's arrays (`NibbleMatrix`), from its first group on.
struct RowArrays {
  const int4* words;      // a group's 4 words
  const int2* tops;       // Q6_K: a group's two top-bit words
  const __half* pairs;    // Q4_0: d per group; Q4_1: (d, m) per group; Q4_K: (d, dmin) per 8 groups; Q6_K: d per 8
  const uint16_t* sub;    // Q4_K: (scale, min) bytes per group; Q6_K: the halves' signed scales
};

template <int FORMAT>
__device__ inline RowArrays row_arrays(const int4* words, const int2* tops, const __half* pairs, const uint8_t* sub,
                                       int64_t row, int groups) {
  const int64_t first = row * groups;
  RowArrays a;
  a.words = words + first;
  a.tops = tops + first;
  a.sub = reinterpret_cast<const uint16_t*>(sub) + first;
  if constexpr (FORMAT == kQ4_0) a.pairs = pairs + first;
  if constexpr (FORMAT == kQ4_1) a.pairs = pairs + 2 * first;
  if constexpr (FORMAT == kQ4_K) a.pairs = pairs + 2 * (row * (groups / 8));
  if constexpr (FORMAT == kQ6_K) a.pairs = pairs + row * (groups / 8);
  return a;
}

struct Loaded {
  int4 words;
  int2 tops;        // Q6_K: the group's two top-bit words
  float scale[2];   // the group's weight scale (Q6_K: of each half)
  float minimum;    // the group's min term (Q4_x)

  // A value that exists once every load of the group has arrived.
  __device__ int arrived() const {
    return words.x ^ tops.x ^ tops.y ^ __float_as_int(scale[0]) ^ __float_as_int(scale[1]) ^
           __float_as_int(minimum);
  }
};

template <int FORMAT>
__device__ inline Loaded load_group(const RowArrays& a, int g) {
  Loaded l;
  l.words = stream_load(a.words + g);
  l.tops = make_int2(0, 0);
  if constexpr (FORMAT == kQ6_K) {
    l.tops = __ldg(a.tops + g);
    const float d = __half2float(a.pairs[g / 8]);
    const uint16_t s = __ldg(a.sub + g);
    l.scale[0] = d * static_cast<float>(static_cast<int8_t>(s & 0xFF));
    l.scale[1] = d * static_cast<float>(static_cast<int8_t>(s >> 8));
    l.minimum = 0.0f;
  } else if constexpr (FORMAT == kQ4_K) {
    const float2 dm = __half22float2(__ldg(reinterpret_cast<const __half2*>(a.pairs) + g / 8));
    const uint16_t s = __ldg(a.sub + g);
    l.scale[0] = l.scale[1] = dm.x * static_cast<float>(s & 0xFF);
    l.minimum = -(dm.y * static_cast<float>(s >> 8));
  } else if constexpr (FORMAT == kQ4_1) {
    const float2 dm = __half22float2(__ldg(reinterpret_cast<const __half2*>(a.pairs) + g));
    l.scale[0] = l.scale[1] = dm.x;
    l.minimum = dm.y;
  } else {
    l.scale[0] = l.scale[1] = __half2float(a.pairs[g]);
    l.minimum = -8.0f * l.scale[0];
  }
  return l;
}

// sum + the bytes of a (unsigned) . the bytes of b (signed)
__device__ inline int dot_unsigned_signed(unsigned a, int b, int sum) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sum));
  return d;
}

// A 4-bit group's integer dot product with one part of an input row (x0, x1: its values 0..15 and 16..31), exact:
// the low nibbles as they are, the high ones left in place (16x their value: bytes 0..240, taken as unsigned), their
// sum divided by 16 once (exactly: every term is a multiple of 16).
__device__ inline int nibble_group_dot(const int4& w, const int4& x0, const int4& x1) {
  int high = dot_unsigned_signed(static_cast<unsigned>(w.x) & ~kNibbles, x1.x, 0);
  high = dot_unsigned_signed(static_cast<unsigned>(w.y) & ~kNibbles, x1.y, high);
  high = dot_unsigned_signed(static_cast<unsigned>(w.z) & ~kNibbles, x1.z, high);
  high = dot_unsigned_signed(static_cast<unsigned>(w.w) & ~kNibbles, x1.w, high);
  int sum = __dp4a(static_cast<int>(static_cast<unsigned>(w.x) & kNibbles), x0.x, high >> 4);
  sum = __dp4a(static_cast<int>(static_cast<unsigned>(w.y) & kNibbles), x0.y, sum);
  sum = __dp4a(static_cast<int>(static_cast<unsigned>(w.z) & kNibbles), x0.z, sum);
  return __dp4a(static_cast<int>(static_cast<unsigned>(w.w) & kNibbles), x0.w, sum);
}

// A Q6_K group's values as dp4a operands (the nibbles joined with their top bits, values 0..63): word u's values
// 4u..4u+3 (first) and 16+4u..16+4u+3 (second).
__device__ inline void six_bit_operands(const Loaded& l, unsigned (&first)[4], unsigned (&second)[4]) {
  const unsigned w[4] = {static_cast<unsigned>(l.words.x), static_cast<unsigned>(l.words.y),
                         static_cast<unsigned>(l.words.z), static_cast<unsigned>(l.words.w)};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    first[u] = (w[u] & kNibbles) | (((static_cast<unsigned>(l.tops.x) >> (2 * u)) & 0x03030303u) << 4);
    second[u] = ((w[u] >> 4) & kNibbles) | (((static_cast<unsigned>(l.tops.y) >> (2 * u)) & 0x03030303u) << 4);
  }
}

// The input rows (`QuantizedInput`'s arrays).
struct Inputs {
  const int8_t* high;
  const int8_t* low;
  const float* scale;
  const float* total;
  const float* half_total;
};

// Group g of the warp's weight rows against every input row, into acc (the float chain of the file's header).
template <int FORMAT, int MAX_ROWS, int PARTS>
__device__ inline void accumulate_group(const Loaded (&l)[kRowsPerWarp], int g, int rows, int groups, const Inputs& in,
                                        float (&acc)[MAX_ROWS][kRowsPerWarp]) {
  unsigned first[kRowsPerWarp][4], second[kRowsPerWarp][4];
  if constexpr (FORMAT == kQ6_K) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) six_bit_operands(l[r], first[r], second[r]);
  }
#pragma unroll
  for (int m = 0; m < MAX_ROWS; ++m) {
    if (MAX_ROWS > 1 && m >= rows) break;  // (one row: no branch, which would let the loads sink past it)
    const int64_t xg = static_cast<int64_t>(m) * groups + g;
    const int4* xh = reinterpret_cast<const int4*>(in.high + xg * 32);
    const int4 h0 = __ldg(xh), h1 = __ldg(xh + 1);
    int4 l0 = make_int4(0, 0, 0, 0), l1 = l0;
    if constexpr (PARTS == 2) {
      const int4* xl = reinterpret_cast<const int4*>(in.low + xg * 32);
      l0 = __ldg(xl);
      l1 = __ldg(xl + 1);
    }
    const float dx = __ldg(in.scale + xg);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if constexpr (FORMAT == kQ6_K) {
        int sum_first, sum_second;
        group_dots(first[r], second[r], h0, h1, sum_first, sum_second);
        if constexpr (PARTS == 2) {
          int low_first, low_second;
          group_dots(first[r], second[r], l0, l1, low_first, low_second);
          sum_first = sum_first * 256 + low_first;
          sum_second = sum_second * 256 + low_second;
        }
        const float sx_first = __ldg(in.half_total + 2 * xg), sx_second = __ldg(in.half_total + 2 * xg + 1);
        const float first_half = __fsub_rn(__fmul_rn(dx, static_cast<float>(sum_first)), __fmul_rn(32.0f, sx_first));
        const float second_half =
            __fsub_rn(__fmul_rn(dx, static_cast<float>(sum_second)), __fmul_rn(32.0f, sx_second));
        acc[m][r] = __fadd_rn(acc[m][r], __fmul_rn(l[r].scale[0], first_half));
        acc[m][r] = __fadd_rn(acc[m][r], __fmul_rn(l[r].scale[1], second_half));
      } else {
        int sum = nibble_group_dot(l[r].words, h0, h1);
        if constexpr (PARTS == 2) sum = sum * 256 + nibble_group_dot(l[r].words, l0, l1);
        const float dots = __fmul_rn(__fmul_rn(l[r].scale[0], dx), static_cast<float>(sum));
        acc[m][r] = __fadd_rn(acc[m][r], __fadd_rn(dots, __fmul_rn(l[r].minimum, __ldg(in.total + xg))));
      }
    }
  }
}

// MAX_ROWS: 1, or 8 for 1 to 8 rows (`rows`).
template <int FORMAT, int MAX_ROWS, int PARTS, typename OutT>
__global__ void __launch_bounds__(kWarps * 32, DFLASH_MIN_BLOCKS) nibble_rows_kernel(
    const int8_t* __restrict__ high, const int8_t* __restrict__ low, const float* __restrict__ scale,
    const float* __restrict__ total, const float* __restrict__ half_total, const int4* __restrict__ words,
    const int2* __restrict__ tops, const __half* __restrict__ pairs, const uint8_t* __restrict__ sub,
    OutT* __restrict__ out, int rows, int n, int k, int64_t out_stride) {
  const int lane = threadIdx.x % 32;
  const int64_t first_row = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kRowsPerWarp;
  if (first_row >= n) return;
  const int groups = k / 32;
  const int zero = n >> 31;  // n >= 0: 0, which the compiler cannot know
  const Inputs in{high, low, scale, total, half_total};
  RowArrays arrays[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {  // a missing second row repeats the last one
    arrays[r] = row_arrays<FORMAT>(words, tops, pairs, sub, min(first_row + r, static_cast<int64_t>(n) - 1), groups);
  }
  float acc[MAX_ROWS][kRowsPerWarp];
#pragma unroll
  for (int m = 0; m < MAX_ROWS; ++m) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r] = 0.0f;
  }
  // Whole steps: every load of a step issued before its arithmetic, no bounds to test.
  int g0 = lane;
  for (; g0 + 32 * (kUnroll - 1) < groups; g0 += 32 * kUnroll) {
    Loaded loaded[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int s = 0; s < kUnroll; ++s) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) loaded[s][r] = load_group<FORMAT>(arrays[r], g0 + 32 * s);
    }
    // The arithmetic reads its inputs at g0 + ready: zero, but known only once every word of the step is here, so
    // that the compiler cannot move the step's loads in between the arithmetic (it does, and the loads then wait
    // on each other).
    int ready = 0;
#pragma unroll
    for (int s = 0; s < kUnroll; ++s) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) ready ^= loaded[s][r].arrived();
    }
    ready &= zero;
#pragma unroll
    for (int s = 0; s < kUnroll; ++s) {
      accumulate_group<FORMAT, MAX_ROWS, PARTS>(loaded[s], g0 + ready + 32 * s, rows, groups, in, acc);
    }
  }
  // The lane's last groups one at a time, in the same order.
  for (; g0 < groups; g0 += 32) {
    Loaded loaded[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) loaded[r] = load_group<FORMAT>(arrays[r], g0);
    accumulate_group<FORMAT, MAX_ROWS, PARTS>(loaded, g0, rows, groups, in, acc);
  }
#pragma unroll
  for (int m = 0; m < MAX_ROWS; ++m) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
      acc[m][r] = v;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (first_row + r >= n) break;
#pragma unroll
      for (int m = 0; m < MAX_ROWS; ++m) {
        if (m < rows) store_value(out + m * out_stride + first_row + r, acc[m][r]);
      }
    }
  }
}

template <int FORMAT, int ROWS, int PARTS, typename OutT>
void launch(int rows, const torch::Tensor& high, const torch::Tensor& low, const torch::Tensor& scale, const torch::Tensor& total,
            const torch::Tensor& half_total, const torch::Tensor& words, const torch::Tensor& tops,
            const torch::Tensor& pairs, const torch::Tensor& sub, torch::Tensor& out, int n, int k) {
  const int warps_needed = (n + kRowsPerWarp - 1) / kRowsPerWarp;
  const dim3 grid((warps_needed + kWarps - 1) / kWarps);
  nibble_rows_kernel<FORMAT, ROWS, PARTS, OutT><<<grid, kWarps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      high.data_ptr<int8_t>(), low.data_ptr<int8_t>(), scale.data_ptr<float>(), total.data_ptr<float>(),
      half_total.data_ptr<float>(), reinterpret_cast<const int4*>(words.data_ptr()),
      reinterpret_cast<const int2*>(tops.data_ptr()), reinterpret_cast<const __half*>(pairs.data_ptr()),
      reinterpret_cast<const uint8_t*>(sub.data_ptr()), reinterpret_cast<OutT*>(out.data_ptr()), rows, n, k,
      out.stride(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int FORMAT, int ROWS, int PARTS>
void with_output(int rows, const torch::Tensor& high, const torch::Tensor& low, const torch::Tensor& scale,
                 const torch::Tensor& total, const torch::Tensor& half_total, const torch::Tensor& words,
                 const torch::Tensor& tops, const torch::Tensor& pairs, const torch::Tensor& sub, torch::Tensor& out,
                 int n, int k) {
  if (out.scalar_type() == torch::kBFloat16) {
    launch<FORMAT, ROWS, PARTS, __nv_bfloat16>(rows, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  } else if (out.scalar_type() == torch::kHalf) {
    launch<FORMAT, ROWS, PARTS, __half>(rows, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kFloat32, "out must be bf16, fp16 or float32");
    launch<FORMAT, ROWS, PARTS, float>(rows, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  }
}

template <int FORMAT, int ROWS>
void with_parts(int rows, int64_t parts, const torch::Tensor& high, const torch::Tensor& low, const torch::Tensor& scale,
                const torch::Tensor& total, const torch::Tensor& half_total, const torch::Tensor& words,
                const torch::Tensor& tops, const torch::Tensor& pairs, const torch::Tensor& sub, torch::Tensor& out,
                int n, int k) {
  if (parts == 2) {
    with_output<FORMAT, ROWS, 2>(rows, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  } else {
    with_output<FORMAT, ROWS, 1>(rows, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  }
}

template <int FORMAT>
void with_rows(int64_t rows, int64_t parts, const torch::Tensor& high, const torch::Tensor& low,
               const torch::Tensor& scale, const torch::Tensor& total, const torch::Tensor& half_total,
               const torch::Tensor& words, const torch::Tensor& tops, const torch::Tensor& pairs,
               const torch::Tensor& sub, torch::Tensor& out, int n, int k) {
  TORCH_CHECK(rows >= 1 && rows <= 8, "1 to 8 input rows, not ", rows);
  const int count = static_cast<int>(rows);
  if (rows == 1) {
    with_parts<FORMAT, 1>(count, parts, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  } else {
    with_parts<FORMAT, 8>(count, parts, high, low, scale, total, half_total, words, tops, pairs, sub, out, n, k);
  }
}

}  // namespace

// out[rows, n] = x @ W^T for x rounded to int8 parts (high, low int8 [rows, k]; scale, total float32 [rows, k / 32];
// half_total float32 [rows, k / 16]) and W as words (int32 [n, k / 8]), top bits (Q6_K: int32 [n, k / 16]; else
// any int32 tensor), pairs (fp16) and sub-scales (uint8) as `NibbleMatrix` keeps them.
void nibble_rows(const torch::Tensor& high, const torch::Tensor& low, const torch::Tensor& scale,
                 const torch::Tensor& total, const torch::Tensor& half_total, const torch::Tensor& words,
                 const torch::Tensor& tops, const torch::Tensor& pairs, const torch::Tensor& sub, torch::Tensor out,
                 int64_t format, int64_t parts) {
  const int64_t rows = high.size(0), k = high.size(1), n = words.size(0);
  TORCH_CHECK(high.is_cuda() && high.is_contiguous() && low.is_contiguous() && words.is_contiguous() &&
                  pairs.is_contiguous() && sub.is_contiguous() && tops.is_contiguous(),
              "contiguous CUDA tensors only");
  TORCH_CHECK(k % 32 == 0 && words.size(1) * 8 == k, "words [n, k / 8] for rows of k values");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(words.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(high.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(low.data_ptr()) % 16 == 0,
              "words and inputs must start on 16-byte boundaries");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(pairs.data_ptr()) % 4 == 0, "pairs must start on a 4-byte boundary");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == n && out.stride(1) == 1, "out must be [rows, n]");
  TORCH_CHECK(n < (int64_t{1} << 31) / 8, "too many rows");
  const c10::cuda::CUDAGuard guard(high.device());
  const int in = static_cast<int>(k), outputs = static_cast<int>(n);
  switch (format) {
    case kQ4_0: with_rows<kQ4_0>(rows, parts, high, low, scale, total, half_total, words, tops, pairs, sub, out, outputs, in); break;
    case kQ4_1: with_rows<kQ4_1>(rows, parts, high, low, scale, total, half_total, words, tops, pairs, sub, out, outputs, in); break;
    case kQ4_K: with_rows<kQ4_K>(rows, parts, high, low, scale, total, half_total, words, tops, pairs, sub, out, outputs, in); break;
    case kQ6_K: with_rows<kQ6_K>(rows, parts, high, low, scale, total, half_total, words, tops, pairs, sub, out, outputs, in); break;
    default: TORCH_CHECK(false, "unknown format ", format);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Products of 1 to 8 rows with 4-bit GGUF words by integer dot products (CUDA)";
  module.def("nibble_rows", &nibble_rows, "out = x @ W^T, W as NibbleMatrix words (see the source)");
}
