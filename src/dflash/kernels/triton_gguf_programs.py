"""The Triton programs over raw GGUF blocks; `dflash.kernels.triton_gguf_matmul` is their Python side (formats,
configurations, launches) and imports this module only where Triton is installed.

Both programs walk a weight row in steps of whole blocks and turn a step's bytes into a float32 tile
[BLOCK_N rows, GROUPS, GROUP] (`dequantize_step`): a group is the run of values that share one scale (32 values;
16 in Q6_K), so each scale is loaded once per (row, group) and broadcast over its group, and the tile's value
(r, g, t) is the weight of column step_start + g * GROUP + t: the tile is in the matrix's own column order, and x is
read as it is. A value reads its byte at a computed offset (a nibble's byte twice, once per nibble; the second read
comes from the cache), so no format needs its bytes re-laid out.
"""

from __future__ import annotations

import triton
import triton.language as tl

# FORMAT codes (constexpr); `triton_gguf_matmul.FORMATS` maps the GGML types to them.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 4, 5


@triton.jit
def _half(ptr, mask):  # type: ignore[no-untyped-def]
    """The fp16 at byte address `ptr` (2-aligned in every format) as float32; 0 where masked."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _byte(ptr, mask):  # type: ignore[no-untyped-def]
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(base, j, inside):  # type: ignore[no-untyped-def]
    """Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes at base + 4 (llama.cpp's
    get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in byte j + 4's nibbles with the top two
    bits of bytes j - 4 and j."""
    jj = j % 4
    a = _byte(base + 4 + jj, inside)
    b = _byte(base + 8 + jj, inside)
    c = _byte(base + 12 + jj, inside)
    low = j < 4
    scale = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    minimum = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def dequantize_step(  # type: ignore[no-untyped-def]
    row_ptr, rows_inside, first_block, blocks_per_row,
    FORMAT: tl.constexpr, BLOCK_BYTES: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr,
):
    """The weights of blocks first_block .. first_block + GROUPS / GROUPS_PER_BLOCK - 1 of each row -> float32
    [BLOCK_N, GROUPS, GROUP]; 0 for rows outside the matrix and blocks past the row's end.
    row_ptr: [BLOCK_N] uint8 pointers to each row's first byte; rows_inside: [BLOCK_N] bool."""
    g = tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
    t = tl.arange(0, GROUP)[None, None, :]  # [1, 1, GROUP]
    block = first_block + g // GROUPS_PER_BLOCK  # [1, G, 1]
    j = g % GROUPS_PER_BLOCK  # group within its block
    inside = rows_inside[:, None, None] & (block < blocks_per_row)  # [BN, G, 1]
    base = row_ptr[:, None, None] + block * BLOCK_BYTES  # [BN, G, 1]: each group's block
    if FORMAT == 0:  # Q4_0: d, 16 bytes; value t in byte t % 16 (low nibble first); w = d * (q - 8)
        q = (_byte(base + 2 + t % 16, inside) >> ((t // 16) * 4)) & 15
        w = _half(base, inside) * (q - 8).to(tl.float32)
    elif FORMAT == 1:  # Q4_1: d, m, 16 bytes; w = d * q + m
        q = (_byte(base + 4 + t % 16, inside) >> ((t // 16) * 4)) & 15
        w = _half(base, inside) * q.to(tl.float32) + _half(base + 2, inside)
    elif FORMAT == 2:  # Q8_0: d, 32 int8; w = d * q
        q = tl.load(base + 2 + t, mask=inside, other=0).to(tl.int8, bitcast=True)
        w = _half(base, inside) * q.to(tl.float32)
    elif FORMAT == 3 or FORMAT == 4:  # Q4_K / Q5_K: 8 sub-blocks of 32; w = d * scale_j * q - dmin * min_j
        scale, minimum = _k_scale_min(base, j, inside)
        nibbles = 16 if FORMAT == 3 else 48  # Q5_K keeps 32 bytes of fifth bits before its nibbles
        # sub-blocks 2c and 2c + 1 are the low and high nibbles of the 32 bytes at nibbles + 32 c
        q = (_byte(base + nibbles + 32 * (j // 2) + t, inside) >> (4 * (j % 2))) & 15
        if FORMAT == 4:  # bit j of byte t of the fifth bits
            q = q | (((_byte(base + 16 + t, inside) >> j) & 1) << 4)
        w = (_half(base, inside) * scale) * q.to(tl.float32) - _half(base + 2, inside) * minimum
    else:  # Q6_K: 16 groups of 16 (one int8 scale each); w = d * scale_j * (q - 32), q six bits
        # value v = 16 j + t: half h = v // 128; its low 4 bits in byte 64 h + v % 64 (shift 4 (v % 128 // 64)),
        # its high 2 bits in byte 128 + 32 h + v % 32 (shift 2 (v % 128 // 32))
        half = j // 8
        within = j % 8
        low = (_byte(base + 64 * half + 16 * (within % 4) + t, inside) >> (4 * (within // 4))) & 15
        high = (_byte(base + 128 + 32 * half + 16 * (within % 2) + t, inside) >> (2 * (within // 2))) & 3
        q = (low | (high << 4)) - 32
        scale = tl.load(base + 192 + j, mask=inside, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_half(base + 208, inside) * scale) * q.to(tl.float32)
    return w


@triton.jit
def gguf_matmul_kernel(  # type: ignore[no-untyped-def]
    x_ptr, blocks_ptr, out_ptr, rows, n, k, row_bytes, blocks_per_row, out_stride,
    FORMAT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_VALUES: tl.constexpr, GROUP: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr, GROUPS: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[rows, n] = x[rows, k] @ dequant(W[n, k])^T (out's rows `out_stride` apart: it may be a slice of a wider
    output): each program owns BLOCK_N rows of W (output columns) and reads them once, for every row of x.
    USE_DOT: x padded to BLOCK_M rows, tensor cores on the tile in x's dtype; else one row, multiply-and-add in
    float32 into a [BLOCK_N, GROUPS, GROUP] accumulator."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols_inside = cols < n
    row_ptr = blocks_ptr + cols.to(tl.int64) * row_bytes  # [BLOCK_N]
    if USE_DOT:
        row_ids = tl.arange(0, BLOCK_M)
        rows_inside = row_ids < rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for first in range(0, blocks_per_row, BLOCKS_PER_STEP):
            w = dequantize_step(row_ptr, cols_inside, first, blocks_per_row, FORMAT, BLOCK_BYTES, GROUP, GROUPS,
                                GROUPS_PER_BLOCK)  # [BN, G, GROUP]
            ks = first * BLOCK_VALUES + tl.arange(0, GROUPS * GROUP)  # [STEP] columns of the step
            x = tl.load(
                x_ptr + row_ids[:, None] * k + ks[None, :], mask=rows_inside[:, None] & (ks < k)[None, :], other=0.0
            )  # [BM, STEP]
            tile = tl.reshape(w, (BLOCK_N, GROUPS * GROUP)).to(x.dtype)  # [BN, STEP]
            acc = tl.dot(x, tl.trans(tile), acc, input_precision=PRECISION)
        tl.store(
            out_ptr + row_ids[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
            mask=rows_inside[:, None] & cols_inside[None, :],
        )
    else:
        # products added elementwise, summed once at the end: one reduction per output, not one per step
        total = tl.zeros((BLOCK_N, GROUPS, GROUP), dtype=tl.float32)
        ks_in_step = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        for first in range(0, blocks_per_row, BLOCKS_PER_STEP):
            w = dequantize_step(row_ptr, cols_inside, first, blocks_per_row, FORMAT, BLOCK_BYTES, GROUP, GROUPS,
                                GROUPS_PER_BLOCK)  # [BN, G, GROUP]
            ks = first * BLOCK_VALUES + ks_in_step
            x = tl.load(x_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)  # [G, GROUP]
            total += w * x[None, :, :]
        sums = tl.sum(tl.sum(total, axis=2), axis=1)  # [BLOCK_N]
        tl.store(out_ptr + cols, sums.to(out_ptr.dtype.element_ty), mask=cols_inside)


@triton.jit
def gguf_dequantize_kernel(  # type: ignore[no-untyped-def]
    blocks_ptr, out_ptr, n, k, row_bytes, blocks_per_row,
    FORMAT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_VALUES: tl.constexpr, GROUP: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr, GROUPS: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[n, k] = dequant(W[n, k]) in out's dtype: program (i, s) writes rows i * BLOCK_N.. of step s."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W
    cols_inside = cols < n
    first = tl.program_id(1) * BLOCKS_PER_STEP
    w = dequantize_step(blocks_ptr + cols.to(tl.int64) * row_bytes, cols_inside, first, blocks_per_row, FORMAT,
                        BLOCK_BYTES, GROUP, GROUPS, GROUPS_PER_BLOCK)  # [BN, G, GROUP]
    g = tl.arange(0, GROUPS)[None, :, None]
    t = tl.arange(0, GROUP)[None, None, :]
    ks = first * BLOCK_VALUES + g * GROUP + t  # [1, G, GROUP]
    tl.store(
        out_ptr + cols.to(tl.int64)[:, None, None] * k + ks, w.to(out_ptr.dtype.element_ty),
        mask=cols_inside[:, None, None] & (ks < k),
    )
