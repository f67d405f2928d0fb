"""Row-wise argmax over a vocabulary in two short passes (GPU fast path).

torch's argmax reduces each row in one thread block: for a few rows of a 49,152-entry vocabulary that is one or a
few SMs walking the whole row, about 13 us on an H100, as long as several matrix products of a small model's step.
Here the first pass splits every row into `CHUNK`-entry pieces, one program each (max and its first index), and
the second pass picks, per row, the first piece holding the row's maximum. Ties resolve to the lowest index, as
torch's argmax does, so the greedy tokens are the same.

`fast_argmax` is what the resident rounds call: the program on CUDA (and under TRITON_INTERPRET=1 for the CPU
tests), `torch.argmax` elsewhere.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import interpreting, next_power_of_two, triton_available

CHUNK = 2048  # entries per first-pass program


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_max_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, row_stride, width, chunks, best_ptr, where_ptr, CHUNK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        piece = tl.program_id(1)
        cols = piece * CHUNK + tl.arange(0, CHUNK)
        values = tl.load(logits_ptr + row * row_stride + cols, mask=cols < width, other=-float("inf")).to(tl.float32)
        best = tl.max(values, axis=0)
        first = tl.min(tl.where(values == best, cols, width), axis=0)  # the lowest index holding the maximum
        tl.store(best_ptr + row * chunks + piece, best)
        tl.store(where_ptr + row * chunks + piece, first)

    @triton.jit
    def pick_kernel(best_ptr, where_ptr, chunks, out_ptr, CHUNKS: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0).to(tl.int64)
        pieces = tl.arange(0, CHUNKS)
        inside = pieces < chunks
        best = tl.load(best_ptr + row * chunks + pieces, mask=inside, other=-float("inf"))
        where = tl.load(where_ptr + row * chunks + pieces, mask=inside, other=0)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(inside & (best == top), where, 2147483647), axis=0)
        tl.store(out_ptr + row, first.to(tl.int64))

    return chunk_max_kernel, pick_kernel


def argmax_program_usable(logits: torch.Tensor) -> bool:
    return triton_available() and (logits.is_cuda or interpreting())


def fast_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, width] (unit stride along the width) -> [rows] long, the first index of each row's maximum."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not argmax_program_usable(logits):
        return logits.argmax(dim=-1)
    rows, width = logits.shape
    chunks = -(-width // CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    where = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    chunk_max, pick = _kernels()
    chunk_max[(rows, chunks)](logits, logits.stride(0), width, chunks, best, where, CHUNK=CHUNK, num_warps=4)
    pick[(rows,)](best, where, chunks, out, CHUNKS=next_power_of_two(chunks), num_warps=1)
    return out
