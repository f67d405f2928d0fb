"""The target's choice at every verified row of a device round, for greedy and sampled requests in one batch, on the
device (inside the round's graph: no host read, no host random stream).

A sampled DDTree round is lossless by sampling the target at every tree row and following the child that carries
the sampled token (the host-built rounds' rule, `dflash.speculative.ddtree.tree_choices`): each committed token is
then a sample of the target's distribution given the committed prefix. Here each row's token is drawn by inverse
CDF from the request's filtered distribution (`dflash.generation.sampling.filtered_probs`: temperature, top-k, min-p,
top-p, applied in the same order) with a uniform made by hashing (request seed, the row's position): every row at one
depth of a tree shares its uniform, and a position's uniform decides the token committed after it exactly once (a
round's rows past where its walk ends are never read; the next round draws them again with the same uniform, which
nothing has seen). A tree round's tokens are then a function of the request's seed and the target's distributions
alone: the same through device rounds and host-built rounds (`sample_tree_rows`), in any batch and whatever the
trees. A plain step's row is drawn the same way (`choose_step_rows`: every request of a launched step in one
program, not one chooser call per request): a request sampled through plain steps and rounds in turn uses each
position's uniform once. Rows of a greedy request (temperature 0) take the argmax.

The round's shape says which programs run (`choice_mode`): "greedy" (every request greedy: the argmax alone),
"sampled" (no top-k or top-p: one cumulative sum over the vocabulary in its own order), "filtered" (every sampled
request with top-k or top-p: a sort of every row's scores, the search in that order) or "mixed" (both kinds: both
programs, each request's rows taking its own kind's). A request's tokens never depend on the others' parameters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy
import torch

from dflash.generation.sampling import SamplingParams
from dflash.host_copies import to_device

MASK31 = 0x7FFFFFFF  # uniforms are hashed in 31-bit integers: every product below fits int64
_MIXERS = (0x5BD1E995, 0x27D4EB2F, 0x165667B1)  # odd multipliers below 2**31
_POSITION_MIX, _ROUND_MIX = 0x9E3779B1, 0x85EBCA77  # below 2**32: a 31-bit value times either fits int64
_UNIFORM_BITS = 24  # float32 holds them exactly

T = TypeVar("T", torch.Tensor, numpy.ndarray)


SAMPLED_MODES = ("sampled", "filtered", "mixed")  # `choice_mode`'s modes where some request samples


def choice_mode(params: Sequence[SamplingParams]) -> str:
    """"greedy", "sampled", "filtered" or "mixed" for a round of requests with these sampling parameters."""
    filtered = [_filtered(p) for p in params if not p.greedy]
    if not filtered:
        return "greedy"
    if all(filtered):
        return "filtered"
    return "mixed" if any(filtered) else "sampled"


def _filtered(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0


def device_seed(params: SamplingParams) -> int:
    """A request's 31-bit seed for its rows' uniforms: from its own seed where it gave one, else random."""
    if params.seed is None:
        return random.getrandbits(31)
    folded = params.seed & MASK31 ^ (params.seed >> 31) & MASK31  # any integer names a seed
    return int(_mix(torch.tensor([folded], dtype=torch.long))[0])


@dataclass
class RowSampling:
    """Per-request sampling parameters of a round, on the device (each [requests])."""

    temperature: torch.Tensor  # float32, 0 for a greedy request
    top_k: torch.Tensor  # long, 0: no limit
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seed: torch.Tensor  # long, 31 bits

    @staticmethod
    def zeros(requests: int, device: torch.device, *, pin_memory: bool = False) -> RowSampling:
        def floats() -> torch.Tensor:
            return torch.zeros(requests, dtype=torch.float32, device=device, pin_memory=pin_memory)

        def longs() -> torch.Tensor:
            return torch.zeros(requests, dtype=torch.long, device=device, pin_memory=pin_memory)

        return RowSampling(floats(), longs(), floats(), floats(), longs())

    def fill(self, params: Sequence[SamplingParams], seeds: Sequence[int]) -> None:
        """Write these requests' parameters (host buffers), padding slots after them greedy."""
        count = len(params)
        self.temperature.zero_()
        self.top_k.zero_()
        self.top_p.fill_(1.0)
        self.min_p.zero_()
        self.seed.zero_()
        self.temperature[:count] = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        self.top_k[:count] = torch.tensor([p.top_k for p in params], dtype=torch.long)
        self.top_p[:count] = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        self.min_p[:count] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        self.seed[:count] = torch.tensor(list(seeds), dtype=torch.long)

    def copy_(self, other: RowSampling) -> None:
        for mine, theirs in zip(self.fields(), other.fields(), strict=True):
            mine.copy_(theirs, non_blocking=True)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p, self.seed


def _mix(x: T) -> T:
    """A 31-bit integer hash, elementwise (x: int64 tensor or array, values in [0, 2**31))."""
    for multiplier in _MIXERS:
        x = x ^ (x >> 15)
        x = (x * multiplier) & MASK31
    return x ^ (x >> 13)


def _uniform_bits(seed: T, positions: T) -> T:
    """seed [requests], positions [requests, rows] (int64 tensors or arrays) -> _UNIFORM_BITS-bit integers."""
    key = _mix(seed)[:, None]  # [requests, 1]
    bits = _mix(key ^ ((positions & MASK31) * _POSITION_MIX & MASK31))  # [requests, rows]
    bits = _mix(bits ^ (key * _ROUND_MIX & MASK31))
    return bits >> (31 - _UNIFORM_BITS)


def row_uniforms(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seed [requests] long, positions [requests, rows] long -> uniforms [requests, rows] in [0, 1), a function of
    (seed, position) alone."""
    return _uniform_bits(seed, positions).to(torch.float32) / float(1 << _UNIFORM_BITS)


def host_uniforms(seeds: Sequence[int], positions: Sequence[Sequence[int]]) -> numpy.ndarray:
    """`row_uniforms` computed on the host (the same values): float64 [requests, rows], exact in float32."""
    bits = _uniform_bits(numpy.asarray(seeds, dtype=numpy.int64), numpy.asarray(positions, dtype=numpy.int64))
    return bits.astype(numpy.float64) / float(1 << _UNIFORM_BITS)


def choose_rows(
    logits: torch.Tensor, sampling: RowSampling, uniforms: torch.Tensor | None, mode: str, greedy: torch.Tensor
) -> torch.Tensor:
    """logits [requests, rows, vocab], each row's uniform [requests, rows] (`row_uniforms`, `host_uniforms`; None
    in greedy mode), its argmax `greedy` [requests, rows] -> the target's token at every row [requests, rows]
    (`mode`: `choice_mode`)."""
    if mode == "greedy":
        return greedy
    assert uniforms is not None, "sampled rows need their uniforms"
    scores = logits.float()
    # shifted so the best score is 0 before dividing (a tiny temperature sends the others to -inf, not NaN)
    temperature = sampling.temperature.clamp(min=torch.finfo(torch.float32).tiny)[:, None, None]
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature  # [requests, rows, vocab]
    if mode == "sampled":
        sampled = _in_vocabulary_order(scores, sampling, uniforms)
    elif mode == "filtered":
        sampled = _in_sorted_order(scores, sampling, uniforms)
    else:  # each request by its own kind
        filtered = (sampling.top_k > 0) | (sampling.top_p < 1.0)  # [requests]
        sampled = torch.where(filtered[:, None], _in_sorted_order(scores, sampling, uniforms),
                              _in_vocabulary_order(scores, sampling, uniforms))
    return torch.where((sampling.temperature > 0)[:, None], sampled, greedy)


def _in_vocabulary_order(scores: torch.Tensor, sampling: RowSampling, uniforms: torch.Tensor) -> torch.Tensor:
    """Rows without top-k or top-p: scores [requests, rows, vocab] -> tokens [requests, rows] (min-p applied)."""
    return _searched(_min_p(torch.softmax(scores, dim=-1), sampling), uniforms)


def _in_sorted_order(scores: torch.Tensor, sampling: RowSampling, uniforms: torch.Tensor) -> torch.Tensor:
    """Rows with top-k or top-p, searched in descending order of score: scores [requests, rows, vocab] -> tokens
    [requests, rows] (top-k, then min-p, then top-p: the host's order)."""
    requests, rows, vocab = scores.shape
    scores, order = scores.sort(dim=-1, descending=True)
    # top-k: every score below the k-th best goes (k = 0: none); ties with the k-th stay
    kth_index = (sampling.top_k - 1).clamp(min=0, max=vocab - 1)[:, None, None].expand(requests, rows, 1)
    kth = scores.gather(-1, kth_index)  # [requests, rows, 1]
    limited = (sampling.top_k > 0)[:, None, None]
    scores = torch.where(limited & (scores < kth), float("-inf"), scores)
    probs = _min_p(torch.softmax(scores, dim=-1), sampling)
    # top-p over the sorted (descending) probabilities; the best token always stays
    before = probs.cumsum(-1) - probs
    dropped = before >= sampling.top_p[:, None, None]
    dropped[..., 0] = False
    probs = torch.where(dropped, 0.0, probs)
    return order.gather(-1, _searched(probs, uniforms)[..., None])[..., 0]


def _min_p(probs: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    floor = probs.amax(dim=-1, keepdim=True) * sampling.min_p[:, None, None]
    return torch.where(probs < floor, 0.0, probs)


def _searched(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [requests, rows, vocab] (unnormalised), uniforms [requests, rows] -> the index [requests,
    rows] whose cumulative mass first exceeds uniform x total."""
    vocab = probs.shape[-1]
    cumulative = probs.cumsum(-1)  # [requests, rows, vocab]
    total = cumulative[..., -1]  # [requests, rows]
    # strictly below the total, so the search lands on a token with some probability whatever the rounding
    threshold = torch.minimum(uniforms * total, total * (1 - 2.0**-22))[..., None]  # [requests, rows, 1]
    return torch.searchsorted(cumulative, threshold.contiguous(), right=True).clamp(max=vocab - 1)[..., 0]


def sample_tree_rows(
    logits: torch.Tensor, params: SamplingParams, seed: int, positions: Sequence[int]
) -> torch.Tensor:
    """A host-built tree round's choices the way a device round makes them: logits [rows, vocab] of rows at
    `positions` -> tokens [rows] on the logits' device (a sampled request's rows: `choose_rows`)."""
    sampling, uniforms = _loaded([params], [seed], [list(positions)], logits.device)  # uniforms [1, rows]
    greedy = logits.argmax(dim=-1)[None]  # [1, rows]
    return choose_rows(logits[None], sampling, uniforms, choice_mode([params]), greedy)[0]


def choose_step_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int]
) -> torch.Tensor:
    """A plain step's choices for several requests at once: logits [requests, vocab], each request's row at
    `positions` -> tokens [requests] on the logits' device (the argmax for greedy requests), queued without a wait
    for the device."""
    sampling, uniforms = _loaded(params, seeds, [[p] for p in positions], logits.device)  # uniforms [requests, 1]
    greedy = logits.argmax(dim=-1)[:, None]  # [requests, 1]
    return choose_rows(logits[:, None], sampling, uniforms, choice_mode(params), greedy)[:, 0]


PARAMETERS = 5  # a request's row of a parameter table: temperature, top_k, top_p, min_p, seed


def parameter_table(params: Sequence[SamplingParams], seeds: Sequence[int], columns: int = PARAMETERS) -> numpy.ndarray:
    """float64 [len(params), columns]: each request's parameters in the first `PARAMETERS` columns (seeds below
    2**31 and the parameters' floats are exact in it), the rest zero."""
    table = numpy.zeros((len(params), columns), dtype=numpy.float64)
    table[:, :PARAMETERS] = [
        [p.temperature, p.top_k, p.top_p, p.min_p, seed] for p, seed in zip(params, seeds, strict=True)
    ]
    return table


def table_sampling(table: torch.Tensor) -> RowSampling:
    """A parameter table [requests, >= PARAMETERS] float64 on the device (`parameter_table`) as `RowSampling`."""
    return RowSampling(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(), table[:, 3].float(),
                       table[:, 4].long())


def _loaded(
    params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[Sequence[int]], device: torch.device
) -> tuple[RowSampling, torch.Tensor]:
    """Requests' sampling parameters and their rows' uniforms [requests, rows] (made on the host) on `device`, in
    one host copy (the 24-bit uniforms are exact in the float64 table too)."""
    table = parameter_table(params, seeds, PARAMETERS + (len(positions[0]) if positions else 0))
    table[:, PARAMETERS:] = host_uniforms(seeds, positions)
    on = to_device(torch.from_numpy(table), device)  # [requests, PARAMETERS + rows]
    return table_sampling(on), on[:, PARAMETERS:].float()
