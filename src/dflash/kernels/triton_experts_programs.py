"""The Triton programs of `dflash.kernels.triton_experts` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr, chosen_ptr, gate_up_ptr, act_ptr, hidden, width, choices,
    BW: tl.constexpr, BK: tl.constexpr,
):
    """Grid (tokens * choices, width / BW): one (token, choice) pair's expert, BW of its gate and up outputs over
    the whole hidden size, then SiLU(gate) * up -> act [pairs, width] (x's dtype). gate_up: [experts, 2 * width,
    hidden] (gate rows, then up rows)."""
    pair = tl.program_id(0).to(tl.int64)
    outputs = tl.program_id(1) * BW + tl.arange(0, BW)
    inside = outputs < width
    token = pair // choices
    expert = tl.load(chosen_ptr + pair).to(tl.int64)
    base = gate_up_ptr + expert * 2 * width * hidden
    gate = tl.zeros((BW,), dtype=tl.float32)
    up = tl.zeros((BW,), dtype=tl.float32)
    for start in range(0, hidden, BK):
        columns = start + tl.arange(0, BK)
        within = columns < hidden
        x = tl.load(x_ptr + token * hidden + columns, mask=within, other=0.0).to(tl.float32)
        both = inside[:, None] & within[None, :]
        w_gate = tl.load(base + outputs[:, None] * hidden + columns[None, :], mask=both, other=0.0)
        w_up = tl.load(base + (width + outputs[:, None]) * hidden + columns[None, :], mask=both, other=0.0)
        gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair * width + outputs, act.to(act_ptr.dtype.element_ty), mask=inside)


@triton.jit
def expert_down_kernel(  # type: ignore[no-untyped-def]
    act_ptr, chosen_ptr, weights_ptr, down_ptr, out_ptr, hidden, width, choices,
    BH: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr,
):
    """Grid (tokens, hidden / BH): BH outputs of one token, the routing-weighted sum over its choices of each
    expert's down product of that pair's act -> out [tokens, hidden] (x's dtype). down: [experts, hidden, width].
    Every choice's tile is loaded at once ([KP, BH, BK], KP the choices padded to a power of two), so all the chosen
    experts' reads are in flight together."""
    token = tl.program_id(0).to(tl.int64)
    outputs = tl.program_id(1) * BH + tl.arange(0, BH)
    inside = outputs < hidden
    picks = tl.arange(0, KP)
    picked = picks < choices
    pairs = token * choices + picks  # [KP]
    experts = tl.load(chosen_ptr + pairs, mask=picked, other=0).to(tl.int64)
    scales = tl.load(weights_ptr + pairs, mask=picked, other=0.0).to(tl.float32)
    rows = down_ptr + experts[:, None, None] * hidden * width + outputs[None, :, None] * width  # [KP, BH, 1]
    acc = tl.zeros((KP, BH), dtype=tl.float32)
    for start in range(0, width, BK):
        columns = start + tl.arange(0, BK)
        within = columns < width
        a = tl.load(act_ptr + pairs[:, None] * width + columns[None, :], mask=picked[:, None] & within[None, :],
                    other=0.0).to(tl.float32)  # [KP, BK]
        mask = picked[:, None, None] & inside[None, :, None] & within[None, None, :]
        w = tl.load(rows + columns[None, None, :], mask=mask, other=0.0)  # [KP, BH, BK]
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    total = tl.sum(acc * scales[:, None], axis=0)  # [BH]
    tl.store(out_ptr + token * hidden + outputs, total.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def route_kernel(  # type: ignore[no-untyped-def]
    logits_ptr, chosen_ptr, weights_ptr, experts, TOP_K: tl.constexpr, NORMALISE: tl.constexpr, BE: tl.constexpr,
):
    """Grid (tokens,): a token's router logits -> softmax in float32 -> the TOP_K largest probabilities in
    descending order (ties to the lower expert id), rescaled to sum to 1 where NORMALISE -> chosen [tokens, TOP_K]
    int64, weights [tokens, TOP_K] in the logits' dtype."""
    token = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, BE)
    inside = ids < experts
    logits = tl.load(logits_ptr + token * experts + ids, mask=inside, other=-float("inf")).to(tl.float32)
    peak = tl.max(logits, axis=0)
    exps = tl.where(inside, tl.exp(logits - peak), 0.0)
    probs = exps / tl.sum(exps, axis=0)
    remaining = tl.where(inside, probs, -1.0)
    picks = tl.arange(0, TOP_K)
    top = tl.zeros((TOP_K,), dtype=tl.float32)
    which = tl.zeros((TOP_K,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        first = tl.min(tl.where(remaining == best, ids, BE), axis=0)
        top = tl.where(picks == k, best, top)
        which = tl.where(picks == k, first.to(tl.int64), which)
        remaining = tl.where(ids == first, -1.0, remaining)
    if NORMALISE:
        top = top / tl.sum(top, axis=0)
    tl.store(chosen_ptr + token * TOP_K + picks, which)
    tl.store(weights_ptr + token * TOP_K + picks, top.to(weights_ptr.dtype.element_ty))
