"""4-bit GGUF matrices re-laid for word loads and integer dot products on the GPU (`triton_gguf_int8`).

GGUF interleaves each block's scales with its 4-bit values, in blocks of 18 (Q4_0), 20 (Q4_1) or 144 (Q4_K) bytes,
so a row's values are not at 4-byte-aligned offsets and a program reading them as words must skip the scales.
`NibbleMatrix` keeps the same bits apart, losslessly:

* `words`: int32 [n, k / 8], the 4-bit values of every group of 32 (the run of values that share one scale) as 16
  bytes, byte t holding value t in its low nibble and value t + 16 in its high one: Q4_0 and Q4_1's own order;
  Q4_K's pairs of sub-blocks (byte t: value t of sub-block 2c low, of sub-block 2c + 1 high) are reordered to it.
* Q6_K's 6-bit values keep their low 4 bits in `words` the same way, and their top 2 bits in `high_bits`:
  int32 [n, k / 16], two words per group (its first and second 16 values), bits 2u + 8b of a half's word holding
  the top bits of its value 4u + b, so that `(word >> 2u) & 0x03030303` puts values 4u..4u+3's in byte lanes, beside
  the same values' low nibbles in word u.
* the scales, as the file has them: Q4_0: fp16 [n, k / 32, 1] (d) with w = d (q - 8); Q4_1: fp16 [n, k / 32, 2]
  (d, m) with w = d q + m; Q4_K: fp16 [n, k / 256, 2] (d, dmin) and uint8 [n, k / 32, 2] (6-bit scale, 6-bit
  min), with w = d scale q - dmin min; Q6_K: fp16 [n, k / 256, 1] (d) and the int8 scale of every 16 values as
  uint8 [n, k / 16], with w = d scale (q - 32). The bytes per weight are the file's (Q4_K: 4.625 bits against
  4.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

__all__ = ["NIBBLE_FORMATS", "NibbleMatrix", "nibble_matrix", "select_rows"]

T = GGMLQuantizationType
GROUP = 32
NIBBLE_FORMATS = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)


@dataclass(frozen=True)
class NibbleMatrix:
    qtype: GGMLQuantizationType
    n: int
    k: int
    words: torch.Tensor  # int32 [n, k // 8]
    pairs: torch.Tensor  # fp16: Q4_0 [n, k // 32, 1] (d); Q4_1 [n, k // 32, 2] (d, m); Q4_K [n, k // 256, 2]
    # (d, dmin); Q6_K [n, k // 256, 1] (d)
    sub_scales: torch.Tensor | None = None  # uint8: Q4_K [n, k // 32, 2] (scale, min); Q6_K [n, k // 16] (int8 scale)
    high_bits: torch.Tensor | None = None  # Q6_K: int32 [n, k // 16]

    def to(self, device: torch.device | str) -> NibbleMatrix:
        return NibbleMatrix(self.qtype, self.n, self.k, self.words.to(device), self.pairs.to(device),
                            *(None if t is None else t.to(device) for t in (self.sub_scales, self.high_bits)))

    @property
    def nbytes(self) -> int:
        extra = sum(0 if t is None else t.numel() * t.element_size() for t in (self.sub_scales, self.high_bits))
        return self.words.numel() * 4 + self.pairs.numel() * 2 + extra

    def dequantized(self) -> torch.Tensor:
        """The weights [n, k] in float32 (tests, and the reference for the products)."""
        nibbles = self.words.view(torch.uint8).view(self.n, self.k // GROUP, 16)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # [n, groups, 32] in value order
        if self.qtype == T.Q6_K:
            assert self.sub_scales is not None and self.high_bits is not None
            shifts = _HIGH_SHIFTS.to(self.high_bits.device)
            top = (self.high_bits.view(self.n, self.k // GROUP, 2, 1, 1) >> shifts) & 3  # [n, g, 2, u, b]
            q = q + 16 * top.reshape(self.n, self.k // GROUP, 32).float()
            scale = self.pairs.float().repeat_interleave(16, dim=1)[..., 0] * self.sub_scales.view(torch.int8).float()
            return ((q.view(self.n, -1, 16) - 32) * scale[..., None]).reshape(self.n, self.k)
        if self.qtype == T.Q4_K:
            assert self.sub_scales is not None
            pairs = self.pairs.float().repeat_interleave(8, dim=1)  # [n, groups, 2]
            scale = pairs[..., 0] * self.sub_scales[..., 0].float()
            minimum = -pairs[..., 1] * self.sub_scales[..., 1].float()
        elif self.qtype == T.Q4_1:
            scale, minimum = self.pairs[..., 0].float(), self.pairs[..., 1].float()
        else:
            scale = self.pairs[..., 0].float()
            minimum = -8 * scale
        return (q * scale[..., None] + minimum[..., None]).reshape(self.n, self.k)


# values re-laid per pass: the passes' int32/int64 temporaries stay within a few hundred MB (a 248K-row LM head
# at once would need several GB beside the model)
_VALUES_PER_PASS = 1 << 25


def nibble_matrix(blocks: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> NibbleMatrix:
    """blocks: uint8 [n, row bytes] of Q4_0, Q4_1, Q4_K or Q6_K rows of k values (on any device) -> the same weights
    re-laid (on the blocks' device), a bounded number of rows at a time into the final tensors."""
    if qtype not in NIBBLE_FORMATS:
        raise ValueError(f"{qtype.name} is not a 4-bit format the word programs read")
    n = blocks.shape[0]
    rows = max(1, _VALUES_PER_PASS // k)
    if n <= rows:
        return _relaid(blocks, qtype, k)
    first = _relaid(blocks[:rows], qtype, k)
    fields = [first.words, first.pairs, first.sub_scales, first.high_bits]
    out = [None if t is None else t.new_empty((n, *t.shape[1:])) for t in fields]
    for start in range(0, n, rows):
        part = first if start == 0 else _relaid(blocks[start : start + rows], qtype, k)
        for target, piece in zip(out, (part.words, part.pairs, part.sub_scales, part.high_bits), strict=True):
            if target is not None and piece is not None:
                target[start : start + piece.shape[0]] = piece
    words, pairs, sub_scales, high_bits = out
    assert words is not None and pairs is not None
    return NibbleMatrix(qtype, n, k, words, pairs, sub_scales, high_bits)


def _relaid(blocks: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> NibbleMatrix:
    n = blocks.shape[0]
    if qtype == T.Q6_K:
        return _six_bit_matrix(blocks, n, k)
    if qtype in (T.Q4_0, T.Q4_1):
        size = 18 if qtype == T.Q4_0 else 20
        raw = blocks.reshape(n, k // GROUP, size)
        head = size - 16
        nibbles = raw[..., head:]  # [n, groups, 16], already in the target order
        pairs = raw[..., :head].contiguous().view(torch.float16)  # [n, groups, 1 or 2]: d (and m)
        return NibbleMatrix(qtype, n, k, _as_words(nibbles, n, k), pairs)
    raw = blocks.reshape(n, k // 256, 144)
    pairs = raw[..., :4].contiguous().view(torch.float16).view(n, k // 256, 2)  # (d, dmin)
    packed = raw[..., 4:16].to(torch.int32)  # [n, blocks, 12]: llama.cpp's get_scale_min_k4 layout
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=-1)  # [n, blocks, 8]
    minimum = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=-1)
    sub_scales = torch.stack([scale, minimum], dim=-1).to(torch.uint8).view(n, k // GROUP, 2)
    chunks = raw[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
    values = torch.stack([chunks & 15, chunks >> 4], dim=3).reshape(n, k // GROUP, 32)  # [n, groups, 32] in order
    nibbles = values[..., :16] | (values[..., 16:] << 4)  # byte t: value t low, t + 16 high
    return NibbleMatrix(qtype, n, k, _as_words(nibbles, n, k), pairs.contiguous(), sub_scales.contiguous())


# value 4u + b of a half: its top bits at bit 2u + 8b of the half's word
_HIGH_SHIFTS = (2 * torch.arange(4)[:, None] + 8 * torch.arange(4)[None, :]).to(torch.int32)  # [u, b]


def _six_bit_matrix(blocks: torch.Tensor, n: int, k: int) -> NibbleMatrix:
    """Q6_K blocks (128 bytes of low 4 bits, 64 of top 2 bits, 16 int8 scales, fp16 d per 256 values) re-laid."""
    raw = blocks.reshape(n, k // 256, 210)
    v = torch.arange(256, device=blocks.device)
    half, r = v // 128, v % 128  # llama.cpp's dequantize_row_q6_K: value v's bits
    low = (raw[..., 64 * half + r % 64].to(torch.int32) >> (4 * (r // 64))) & 15  # [n, blocks, 256]
    top = (raw[..., 128 + 32 * half + r % 32].to(torch.int32) >> (2 * (r // 32))) & 3
    low = low.view(n, k // GROUP, 32)
    nibbles = (low[..., :16] | (low[..., 16:] << 4)).to(torch.uint8)  # byte t: value t low, t + 16 high
    spread = top.view(n, k // GROUP, 2, 4, 4).to(torch.int64) << _HIGH_SHIFTS.to(blocks.device, torch.int64)
    packed = spread.sum(dim=(-1, -2))  # [n, groups, 2], below 2^32
    high_bits = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).view(n, k // 16)
    scales = raw[..., 192:208].contiguous().view(n, k // 16)  # int8 bits
    d = raw[..., 208:210].contiguous().view(torch.float16)  # [n, blocks, 1]
    return NibbleMatrix(T.Q6_K, n, k, _as_words(nibbles, n, k), d, scales, high_bits.contiguous())


def _as_words(nibbles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 [n, groups, 16] -> int32 [n, k // 8] (little-endian: byte 4 i + b is bits 8 b of word i)."""
    return nibbles.contiguous().view(n, k // 2).view(torch.int32)


def select_rows(matrix: NibbleMatrix, ids: torch.Tensor) -> NibbleMatrix:
    """The rows `ids` [m] of the matrix (a looked-up embedding, an LM head cut to a shortlist)."""
    return NibbleMatrix(matrix.qtype, int(ids.numel()), matrix.k, matrix.words.index_select(0, ids),
                        matrix.pairs.index_select(0, ids),
                        *(None if t is None else t.index_select(0, ids) for t in (matrix.sub_scales, matrix.high_bits)))
