"""How many positions the batched core's K/V pools hold by default: room for a few full contexts, within memory.

The pools are allocated once. Their default is `min(max_batch, 4)` full contexts (a request reserves its prompt
plus its max tokens on admission, so shorter requests share that room), capped so that target and drafter pools
together take at most a quarter of the machine's RAM on the CPU (untouched pages cost nothing there, but a busy
server touches them) or half of the GPU memory free when the engine starts; never less than one full context, so
that every request the context check accepts can run.
"""

from __future__ import annotations

import os

import torch

from dflash.drafter.model import DFlashDrafter
from dflash.models.model import CausalLM


def bytes_per_position(target: CausalLM, drafter: DFlashDrafter | None) -> int:
    """K/V bytes one position takes in the target pool plus the drafter pool (a hybrid's linear layers and Gemma 4's
    K/V-sharing layers take none)."""
    config = target.layer_config
    size = target.embed_tokens.weight.element_size()
    total = 2 * config.cache_layers * config.cache_kv_heads * config.cache_head_dim * size
    if drafter is not None:
        d = drafter.config
        total += 2 * d.num_layers * d.num_kv_heads * d.head_dim * drafter.fc.weight.element_size()
    return total


def memory_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):  # no sysconf: no cap beyond the context floor
        return 1 << 62


def pool_floor_tokens(*, max_ctx: int, round_rows: int) -> int:
    """The fewest positions the pools take: one full context and a round's rows past it, so that every request the
    context check accepts can run (`round_rows`: the most rows a round writes past a request's committed
    positions)."""
    return max_ctx + 2 * round_rows


def pool_floor_fits(target: CausalLM, drafter: DFlashDrafter | None, *, max_ctx: int, round_rows: int) -> bool:
    """Whether the pools' floor fits the memory budget now (on a GPU: half the free memory, the single-request
    path's cache and graphs being already allocated), i.e. whether a batched core can be made beside them."""
    floor = pool_floor_tokens(max_ctx=max_ctx, round_rows=round_rows) * bytes_per_position(target, drafter)
    return floor <= memory_budget(target.embed_tokens.weight.device)


def default_pool_tokens(
    target: CausalLM, drafter: DFlashDrafter | None, *, max_batch: int, max_ctx: int, round_rows: int
) -> int:
    """Positions for the pools (`round_rows`: as for `pool_floor_tokens`)."""
    floor = pool_floor_tokens(max_ctx=max_ctx, round_rows=round_rows)
    wanted = min(max_batch, 4) * max_ctx + max_batch * 2 * round_rows
    fits = memory_budget(target.embed_tokens.weight.device) // max(1, bytes_per_position(target, drafter))
    return max(floor, min(wanted, fits))
