"""Top-k log-probabilities of a few logit rows over a large vocabulary, in two Triton programs.

DDTree's device tree needs, per drafted position, the k best tokens and their log-probabilities
(``logit - logsumexp(row)``). torch spends about a dozen kernels on it (a float copy, a multi-pass radix top-k,
a sort, the logsumexp's reductions); here:

1. one program per (row, vocabulary segment): the segment's max and sum of ``exp(x - max)``, and its k best
   entries;
2. one program per row: the k best of its segments' candidates, and the row's logsumexp from the partial sums.

Entries travel as packed int64 keys (the float's order-preserving bits above the inverted index), so one max
reduction finds the best entry, ties going to the lower token id; k best = k rounds of max-and-remove (a
register sort of the segment is several times slower on the GPU).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

SEGMENT = 2048  # vocabulary entries per first-stage program (fewer for a smaller vocabulary)
WARPS = 4  # per program; each of the k rounds is a cross-warp reduction (4: fastest on an H100)


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def segment_topk_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, keys_ptr, max_ptr, sum_ptr, vocab, stride, group, group_stride, segments,
        SEG: tl.constexpr, K: tl.constexpr,
    ):
        row = tl.program_id(0)
        segment = tl.program_id(1)
        cols = segment * SEG + tl.arange(0, SEG)
        inside = cols < vocab
        # rows come in groups (a batch's trees): row r is row r % group of group r // group
        start = (row // group).to(tl.int64) * group_stride + (row % group).to(tl.int64) * stride
        x = tl.load(logits_ptr + start + cols, mask=inside, other=-float("inf")).to(tl.float32)
        top = tl.max(x, axis=0)  # finite: every segment holds real entries
        tl.store(max_ptr + row * segments + segment, top)
        tl.store(sum_ptr + row * segments + segment, tl.sum(tl.exp(x - top), axis=0))
        # keys: non-negative int64, larger for a larger value, then a lower index: the float's order-preserving
        # unsigned bits above 31 bits of (2^31 - 1 - index); -1 for padding
        bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        ordered = tl.where(bits >= 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
        keys = tl.where(inside, (ordered << 31) | (0x7FFFFFFF - cols.to(tl.int64)), -1)
        out = keys_ptr + (row * segments + segment) * K
        for slot in range(0, K):
            best = tl.max(keys, axis=0)
            tl.store(out + slot, best)
            keys = tl.where(keys == best, -1, keys)

    @triton.jit
    def merge_topk_kernel(  # type: ignore[no-untyped-def]
        keys_ptr, max_ptr, sum_ptr, log_probs_ptr, ids_ptr, segments,
        C: tl.constexpr, S: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    ):
        row = tl.program_id(0)
        candidates = tl.arange(0, C)
        keys = tl.load(keys_ptr + row * segments * K + candidates, mask=candidates < segments * K, other=-1)
        slots = tl.arange(0, KP)
        top_keys = tl.full([KP], -1, dtype=tl.int64)
        for slot in range(0, K):
            best = tl.max(keys, axis=0)
            top_keys = tl.where(slots == slot, best, top_keys)
            keys = tl.where(keys == best, -1, keys)
        keys = top_keys
        parts = tl.arange(0, S)
        part_max = tl.load(max_ptr + row * segments + parts, mask=parts < segments, other=-float("inf"))
        part_sum = tl.load(sum_ptr + row * segments + parts, mask=parts < segments, other=0.0)
        top = tl.max(part_max, axis=0)
        log_sum = top + tl.log(tl.sum(part_sum * tl.exp(part_max - top), axis=0))
        index = 0x7FFFFFFF - (keys & 0x7FFFFFFF)
        ordered = keys >> 31
        bits = tl.where(ordered >= 0x80000000, ordered ^ 0x80000000, (~ordered) & 0xFFFFFFFF)
        value = bits.to(tl.uint32).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
        tl.store(log_probs_ptr + row * K + slots, value - log_sum, mask=slots < K)
        tl.store(ids_ptr + row * K + slots, index, mask=slots < K)

    return segment_topk_kernel, merge_topk_kernel


def _power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class TopKScratch:
    """The intermediate buffers of `draft_topk` for `rows` rows of `vocab` logits and k = `k` (made once, before
    graph capture)."""

    def __init__(
        self, rows: int, vocab: int, k: int, device: torch.device, segment: int = SEGMENT, warps: int = WARPS
    ) -> None:
        self.segment = max(_power_of_two(k), min(segment, _power_of_two(vocab)))
        self.segments = -(-vocab // self.segment)
        self.k, self.warps = k, warps
        self.keys = torch.empty((rows, self.segments * k), dtype=torch.long, device=device)
        self.maxima = torch.empty((rows, self.segments), dtype=torch.float32, device=device)
        self.sums = torch.empty((rows, self.segments), dtype=torch.float32, device=device)


def draft_topk(
    logits: torch.Tensor, scratch: TopKScratch, log_probs: torch.Tensor, ids: torch.Tensor
) -> None:
    """logits: [rows, vocab], or [groups, rows per group, vocab] for the rows of several trees (any float dtype,
    unit stride along the vocabulary) -> fills log_probs [rows, k] float32 (``logit - logsumexp(row)``,
    descending) and ids [rows, k] long (rows: every group's in turn); k <= vocab."""
    grouped = logits if logits.dim() == 3 else logits[None]
    groups, group, vocab = grouped.shape
    rows = groups * group
    segment_kernel, merge_kernel = _kernels()
    k, segments = scratch.k, scratch.segments
    assert grouped.stride(2) == 1 and k <= vocab and rows <= scratch.keys.shape[0]
    segment_kernel[(rows, segments)](
        grouped, scratch.keys, scratch.maxima, scratch.sums, vocab, grouped.stride(1), group, grouped.stride(0),
        segments,
        SEG=scratch.segment, K=k, num_warps=scratch.warps,
    )
    merge_kernel[(rows,)](
        scratch.keys, scratch.maxima, scratch.sums, log_probs, ids, segments,
        C=_power_of_two(segments * k), S=_power_of_two(segments), K=k, KP=_power_of_two(k), num_warps=scratch.warps,
    )
