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
    BH: tl.constexpr, BK: tl.constexpr,
):
    """Grid (tokens, hidden / BH): BH outputs of one token, the routing-weighted sum over its choices of each
    expert's down product of that pair's act -> out [tokens, hidden] (x's dtype). down: [experts, hidden, width]."""
    token = tl.program_id(0).to(tl.int64)
    outputs = tl.program_id(1) * BH + tl.arange(0, BH)
    inside = outputs < hidden
    total = tl.zeros((BH,), dtype=tl.float32)
    for choice in range(choices):
        pair = token * choices + choice
        expert = tl.load(chosen_ptr + pair).to(tl.int64)
        base = down_ptr + expert * hidden * width
        acc = tl.zeros((BH,), dtype=tl.float32)
        for start in range(0, width, BK):
            columns = start + tl.arange(0, BK)
            within = columns < width
            a = tl.load(act_ptr + pair * width + columns, mask=within, other=0.0).to(tl.float32)
            w = tl.load(base + outputs[:, None] * width + columns[None, :], mask=inside[:, None] & within[None, :],
                        other=0.0)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        total += acc * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + token * hidden + outputs, total.to(out_ptr.dtype.element_ty), mask=inside)
