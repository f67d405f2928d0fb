"""The gated delta rule's chunked form through flash-linear-attention's Triton kernels (the `fla-core` package), on
CUDA devices.

Gated DeltaNet layers prefill long runs of rows with the chunked form; in torch (`dflash.models.delta_rule`) that is
a Python loop of a dozen operations per 64-row chunk and layer, so a long prompt through a hybrid model costs
hundreds of thousands of launches. `chunk_gated_delta_rule` does the same work in a few kernels. It serves where the
package is installed (the `gpu` extra), the rows are on a CUDA device and `DFLASH_FLA` is not off; the torch form
stays the reference and the fallback everywhere else.

Only prompt chunks take it. Decoding steps, verification blocks and trees keep the torch recurrence, whose steps the
recurrent state replays when a speculative round keeps part of its rows (`dflash.kv.recurrent`): every decoding
strategy then runs the same arithmetic after the prompt, and speculative outputs stay equal to plain ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from dflash.environment import fla_enabled


@functools.cache
def _chunk_kernel() -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no backend it recognises on this machine
        return None
    return chunk_gated_delta_rule


def fla_usable(rows: torch.Tensor) -> bool:
    """Whether `fla_chunked_delta_rule` serves tensors like `rows` (CUDA, package importable, not switched off)."""
    return rows.is_cuda and fla_enabled() and _chunk_kernel() is not None


def fla_chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dflash.models.delta_rule.chunked_delta_rule`'s contract (float32, heads before time: q, k [batch, heads,
    seq, key_dim], v [batch, heads, seq, value_dim], g, beta [batch, heads, seq], state [batch, heads, key_dim,
    value_dim]; q already scaled) -> (outputs [batch, heads, seq, value_dim], final state), in one kernel call."""
    kernel = _chunk_kernel()
    if kernel is None:
        raise RuntimeError("flash-linear-attention (fla-core) is not importable here")
    out, final = kernel(
        q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
        g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous(),
        scale=1.0, initial_state=state.contiguous(), output_final_state=True,
    )  # out [batch, seq, heads, value_dim]
    return out.transpose(1, 2).float(), final.float()
