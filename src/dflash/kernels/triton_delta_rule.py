"""The gated delta rule over a few rows in one program per (sequence, head, value block): decode steps, verification
chains, verification trees and the rollback replays of `dflash.kv.recurrent`.

In torch the token-by-token rule (`dflash.models.delta_rule`) is five kernels per row and layer: a 16-row
verification of a 48-linear-layer model launches thousands of them, and the rollback that replays the kept rows
as many again. Here each program holds one [key_dim, BV] tile of a head's state in registers and walks the rows:

    S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t

A tree's rows (`ancestors`, [rows, rows] bool, a row seeing itself and its ancestors) each start from the state
before the forward and take their own path's rows in order, continuing from the previous row when it is the
parent (a chain costs one step a row). Every row's state is thus reached by the same steps a linear pass along its
path takes, in the same order, in the same program shape: decoding one token at a time, verifying a chain, a tree,
and replaying the kept rows all give the same state bit for bit, which is what keeps speculative outputs equal to
plain ones on CUDA.

`delta_rule_rows` runs on CUDA tensors and on the CPU under TRITON_INTERPRET=1; the model and the recurrent states
take it where `delta_rule_program_serves` says so: CUDA tensors (and interpreted CPU ones where a test sets
`SERVES_INTERPRETED`), forwards of at most `dflash.kv.recurrent.ROLLBACK_MAX_ROWS` rows.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from dflash.environment import delta_rule_program_enabled
from dflash.kernels.triton_decode import interpreting, next_power_of_two, triton_available

VALUE_BLOCK = 32  # value columns of the state per program: a [key_dim, 32] float32 tile
SERVES_INTERPRETED = False  # the CPU tests set it to run a model's rows through the interpreted program


@cache
def _kernel() -> Any:
    from dflash.kernels.triton_delta_rule_programs import delta_rows_kernel

    return delta_rows_kernel


def delta_rule_program_usable(rows: torch.Tensor) -> bool:
    """Whether `delta_rule_rows` can run on tensors like `rows` (CUDA with Triton, or the CPU interpreter)."""
    return triton_available() and (rows.is_cuda or interpreting())


def delta_rule_program_serves(rows: torch.Tensor) -> bool:
    """Whether the model's forwards and the states' replays take the program for tensors like `rows` (not where
    `DFLASH_DELTA_RULE_PROGRAM` is off: the torch forms, and hybrids without CUDA graphs)."""
    return (
        delta_rule_program_usable(rows) and (rows.is_cuda or SERVES_INTERPRETED) and delta_rule_program_enabled()
    )


def delta_rule_rows(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    ancestors: torch.Tensor | None = None,
    final: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rule over `rows` rows from `state`, float32, heads before time as in `dflash.models.delta_rule`: q, k
    [batch, heads, rows, key_dim] (q None: no read-out, a replay; or heads / n key heads, each serving n
    consecutive value heads), v [batch, heads, rows, value_dim], g, beta [batch, heads, rows], state [batch, heads,
    key_dim, value_dim] (contiguous).

    ancestors None: a chain; the state after its last row is written to `final` (a new tensor when None; `state`
    itself may be passed: each program reads its tile before writing it). ancestors [rows, rows] bool: a tree;
    each row from its own path, no final state. count: a chain's live rows as a [1] integer tensor on the device
    (a graph padded past them: the final state is after the live rows, later rows' outputs are not written).
    -> (outputs [batch, heads, rows, value_dim] or None, final state or None)."""
    batch, heads, rows, value_dim = v.shape
    key_dim = k.shape[-1]
    if heads % k.shape[1] or (q is not None and q.shape[1] != k.shape[1]):
        raise ValueError(f"{k.shape[1]} key heads cannot serve {heads} value heads")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    state = state.contiguous()
    tree = ancestors is not None
    counted = count is not None and not tree
    make = torch.zeros if counted else torch.empty  # rows past the live ones keep zeros
    out = None if q is None else make((batch, heads, rows, value_dim), dtype=torch.float32, device=k.device)
    if not tree and final is None:
        final = torch.empty_like(state)
    if rows == 0:
        if final is not None and final is not state:
            final.copy_(state)
        return out, final
    if g.stride(-1) != 1 or beta.stride(-1) != 1 or g.stride() != beta.stride():
        g, beta = g.contiguous(), beta.contiguous()
    marks = ancestors.to(torch.int8).contiguous() if ancestors is not None else state  # unread for a chain
    reads = q if q is not None else k
    if reads.stride(-1) != 1:
        reads = reads.contiguous()
    written = out if out is not None else state  # unwritten without a read-out
    block_v = min(VALUE_BLOCK, next_power_of_two(value_dim))
    grid = (batch * heads, -(-value_dim // block_v))
    _kernel()[grid](
        reads, k, v, g, beta, state, marks, count if counted else state, written,
        final if final is not None else state,
        rows, heads, heads // k.shape[1], key_dim, value_dim,
        reads.stride(0), reads.stride(1), reads.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
        written.stride(0), written.stride(1), written.stride(2),
        READ=q is not None, TREE=tree, FINAL=not tree, COUNTED=counted, BK=next_power_of_two(key_dim), BV=block_v,
        num_warps=4,
    )
    return out, (None if tree else final)
