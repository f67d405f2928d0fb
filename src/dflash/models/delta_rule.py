"""The gated delta rule of Gated DeltaNet layers, in plain torch: a recurrent form and a chunked form.

Per value head the layer keeps a state matrix S [key_dim, value_dim]. For each token t, with a decay g_t <= 0 (log
space), a write strength beta_t in (0, 1), an L2-normalised key k_t and a scaled query q_t:

    S <- exp(g_t) * S                      (forget)
    u_t = beta_t * (v_t - S^T k_t)          (the part of v_t the state does not already predict: the delta rule)
    S <- S + k_t u_t^T                      (write)
    o_t = S^T q_t                           (read)

`recurrent_delta_rule` runs this token by token: cheap for a few rows (decode steps, verification blocks) and the
form the cache replays when speculative decoding keeps only part of a block (`dflash.kv.recurrent`).
`tree_delta_rule` runs the rows of a verification tree, each from its parent's state.
`chunked_delta_rule` gives the same result for long prefills with matrix products: within a chunk of C tokens the
writes u solve a unit lower-triangular system (I + L) U = beta V - beta exp(G) K S_0, where
L_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i and G is the cumulative decay inside the chunk; outputs and the
chunk-end state follow from U in closed form.

Every tensor here is float32 with heads before time: q, k [batch, heads, seq, key_dim]; v [batch, heads, seq,
value_dim]; g, beta [batch, heads, seq]; state [batch, heads, key_dim, value_dim].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Rows up to which a forward uses the recurrent form (its cost grows with rows, the chunked form's setup does not).
RECURRENT_MAX_ROWS = 16
CHUNK = 64


def recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token -> (outputs [batch, heads, seq, value_dim], final state [batch, heads, key_dim, value_dim])."""
    batch, heads, _, value_dim = v.shape
    outputs = [v.new_zeros(batch, heads, 0, value_dim)]  # so that zero rows give an empty output
    for t in range(q.shape[2]):
        state = _step(state, k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])[:, :, None])
    return torch.cat(outputs, dim=2), state


def delta_rule_state(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The state after the rows alone (no read-out), with the same operations as `recurrent_delta_rule`, so the
    result equals the state that function reaches over the same rows."""
    for t in range(k.shape[2]):
        state = _step(state, k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
    return state


def tree_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    parents: Sequence[int],
) -> torch.Tensor:
    """Rows of a tree (`parents[t]` < t, -1 for a child of the committed prefix): each row's state is its parent's
    advanced by the row, with the steps a linear pass along its path would take -> outputs [batch, heads, rows,
    value_dim]. The rows' own states are not kept: the cache replays the accepted path afterwards."""
    batch, heads, _, value_dim = v.shape
    states: list[torch.Tensor] = []
    outputs = [v.new_zeros(batch, heads, 0, value_dim)]
    for t, parent in enumerate(parents):
        if not -1 <= parent < t:
            raise ValueError(f"tree row {t} has parent {parent}: parents must come first")
        after = _step(state if parent < 0 else states[parent], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
        states.append(after)
        outputs.append(torch.einsum("bhkv,bhk->bhv", after, q[:, :, t])[:, :, None])
    return torch.cat(outputs, dim=2)


def _step(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token: forget, then write the part of v the state does not predict. k [b, h, key_dim], v [b, h,
    value_dim], g and beta [b, h]."""
    state = state * g[:, :, None, None].exp()
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)  # [batch, heads, value_dim]
    write = (v - predicted) * beta[:, :, None]
    return state + k[:, :, :, None] * write[:, :, None, :]


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk by chunk, equal to `recurrent_delta_rule` up to rounding -> (outputs, final state)."""
    outputs = []
    for lo in range(0, q.shape[2], chunk):
        part = slice(lo, lo + chunk)
        out, state = _one_chunk(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], state)
        outputs.append(out)
    return torch.cat(outputs, dim=2), state


def _one_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    size = q.shape[2]
    decay = g.cumsum(dim=-1)  # [batch, heads, C]: log of the decay from the chunk start to each row
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: the differences there are positive)
    relative = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [b, h, C, C]
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2)) * relative  # diagonal ignored by the unitriangular solve
    rhs = torch.cat((v * beta[..., None], k_beta * decay.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    value_part, key_part = solved.split((v.shape[-1], k.shape[-1]), dim=-1)
    writes = value_part - key_part @ state  # U [batch, heads, C, value_dim]
    scores = (q @ k.transpose(-1, -2)) * relative  # [b, h, C, C], diagonal included: o_i reads its own write
    out = (q * decay.exp()[..., None]) @ state + scores @ writes
    to_end = (decay[..., -1:] - decay).exp()[..., None]  # [b, h, C, 1]: decay from each row to the chunk end
    state = state * decay[..., -1, None, None].exp() + (k * to_end).transpose(-1, -2) @ writes
    return out, state
