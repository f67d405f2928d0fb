"""A mixture's routed experts for a few tokens in two Triton programs: each (token, choice) pair's gated MLP read
straight from the stacked expert weights, no sorting, no grouping.

The grouped product (`models/moe.StackedExperts.grouped`) sorts the pairs by expert, gathers their rows, runs two
grouped products over every expert (most of them empty for a decode step) and scatters the results back: about a
dozen launches per layer, each a few microseconds on a GPU, against the ~11 us the chosen experts' weights take to
stream for one token of a Qwen3-30B-A3B layer (graphed on an H100: 93.6 us a layer for one token, these programs
31.9, the floor 25.6; four tokens 173.5 against 96.8, floor 92.7; `results/gpu_routed_experts_h100.json`). Here:

* `expert_gate_up_kernel`: per pair and block of the expert's width, the gate and up products over the hidden size
  and SiLU(gate) * up;
* `expert_down_kernel`: per token and block of the hidden size, every choice's down product weighted by its
  routing weight and summed in float32;
* `route_kernel`: the router's softmax, top-k and rescaling in one program per token (`route_rows`), instead of
  half a dozen kernels.

A pair reads its expert's weights itself, so two tokens that chose the same expert read it twice: the programs
serve up to `ROUTED_MAX_TOKENS` tokens (decode steps, verifications), the grouped product the rest. A
token's result does not depend on the other tokens in the call. CUDA (and the CPU interpreter, for the tests).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.kernels.triton_decode import interpreting, next_power_of_two, triton_available

ROUTED_MAX_TOKENS = 16  # a 16-row verification 15.3 ms against 20.0 through the grouped product (H100)
# (width outputs per gate/up program, hidden outputs per down program, inputs per gate/up step, inputs per down
# step, warps): few outputs and long steps put many loads in flight (the down program loads every choice's tile
# at once). One configuration for every token count, so that a token's sums run in the same order alone and beside
# others (a plain step and a verification agree bit for bit): the best of a sweep on an H100 at the Qwen3-30B-A3B
# shape for 2 tokens, within 3% of the best for 1 and 4 (`results/gpu_routed_experts_h100.json`)
BLOCKS = (8, 2, 1024, 128, 4)
SERVES_INTERPRETED = False
ROUTE_PROGRAM = True  # False: the router's torch operations (benchmarks set it for their baseline)  # the CPU tests set it to run a model's experts through the interpreted programs


@cache
def _programs() -> tuple[Any, Any, Any]:
    from dflash.kernels.triton_experts_programs import expert_down_kernel, expert_gate_up_kernel, route_kernel

    return expert_gate_up_kernel, expert_down_kernel, route_kernel


def route_program_serves(logits: torch.Tensor) -> bool:
    """Whether `route_rows` takes router logits like `logits` [tokens, experts]: where the routed programs would
    (CUDA in 16-bit floats with Triton; the interpreter for the tests), at most 256 experts."""
    return (
        ROUTE_PROGRAM and triton_available() and logits.shape[-1] <= 256 and logits.stride(-1) == 1
        and ((logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)) or (interpreting() and SERVES_INTERPRETED))
    )


def route_rows(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice in one program per token: softmax in float32, top-k (descending), rescaled to sum to 1
    where `normalise`, cast to the logits' dtype -> (chosen [tokens, k] int64, weights [tokens, k])."""
    tokens, experts = logits.shape
    chosen = torch.empty((tokens, top_k), dtype=torch.long, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=logits.dtype, device=logits.device)
    if tokens:
        _programs()[2][(tokens,)](
            logits.contiguous(), chosen, weights, experts, TOP_K=top_k, NORMALISE=normalise,
            BE=next_power_of_two(experts), num_warps=1,
        )
    return chosen, weights


def routed_programs_serve(x: torch.Tensor) -> bool:
    """Whether `routed_experts` takes tokens like x [tokens, hidden]: few of them, on CUDA with Triton (or under
    the interpreter)."""
    return x.shape[0] <= ROUTED_MAX_TOKENS and triton_available() and (x.is_cuda or interpreting())


def routed_experts(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    *, blocks: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [tokens, hidden]; chosen [tokens, k] expert ids; weights [tokens, k]; gate_up [experts, 2 * width, hidden];
    down [experts, hidden, width] (contiguous) -> [tokens, hidden] in x's dtype: sum over k of weight *
    down(SiLU(gate) * up) of the chosen expert. `blocks`: (width block, hidden block, gate/up reduction block,
    down reduction block, warps), for tuning."""
    tokens, hidden = x.shape
    width_block, hidden_block, reduction, down_reduction, warps = blocks or BLOCKS
    choices = chosen.shape[1]
    width = down.shape[-1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    act = torch.empty((tokens * choices, width), dtype=x.dtype, device=x.device)
    gate_up_program, down_program, _ = _programs()
    flat_chosen = chosen.reshape(-1).contiguous()
    gate_up_program[(tokens * choices, -(-width // width_block))](
        x.contiguous(), flat_chosen, gate_up, act, hidden, width, choices, BW=width_block, BK=reduction, num_warps=warps,
    )
    down_program[(tokens, -(-hidden // hidden_block))](
        act, flat_chosen, weights.reshape(-1).contiguous(), down, out, hidden, width, choices,
        BH=hidden_block, BK=down_reduction, KP=next_power_of_two(choices), num_warps=warps,
    )
    return out
