"""Starting points for training a DFlash2 drafter: its config, and its new parts initialised so that it starts out
computing what the DFlash drafter under it computes.

A DFlash2 drafter is a DFlash drafter plus two block convolutions per layer and a candidate selector
(`dflash.drafter.dflash2`). New parts start neutral:

- each convolution is the identity: in `out[t, c] = sum_o (base[o, c] + dynamic[t, o, g]) * x[t - o, c]` the base
  kernel's tap 0 is 1 and its other taps 0, and the dynamic projection is zero (so `dynamic` is zero whatever the
  input, while its gradient is not: it is linear in the projection);
- the selector's codebooks and hidden projection are small random, so the pairwise term `<A[a] * H(h), B[b]>` is
  tiny (a product of three small factors) and the selector's walk starts as the unary top-1 chain.

So a DFlash2 drafter made from a trained DFlash drafter (`dflash2_from_dflash`) drafts exactly what its source
drafts at the start of training.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig

# the published DFlash2 layout (docs/dflash2.md)
DFLASH2_BLOCK_SIZE = 8
CONV_KERNEL_SIZE = 2
CONV_GROUP_SIZE = 16
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
# spread of the selector's random start: small enough that the pairwise term starts far below the unary scores'
# gaps, large enough that no factor of the trilinear term is zero (all three would then get zero gradient)
SELECTOR_INIT_STD = 0.02


def dflash2_config(
    base: DrafterConfig,
    *,
    block_size: int = DFLASH2_BLOCK_SIZE,
    selector_rank: int = SELECTOR_RANK,
    selector_top_k: int = SELECTOR_TOP_K,
) -> DFlash2Config:
    """The DFlash2 config with `base`'s shared fields (sizes, target layers, mask token), the published convolution
    sizes and `is_causal: false` as published drafters write it (our training layers are full attention, where it
    changes nothing)."""
    if base.hidden_size % CONV_GROUP_SIZE:
        raise ValueError(f"hidden size {base.hidden_size} is not a multiple of the convolution group {CONV_GROUP_SIZE}")
    shared: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(DrafterConfig)}
    shared["block_size"] = block_size
    return DFlash2Config(
        **shared, conv_kernel_size=CONV_KERNEL_SIZE, conv_group_size=CONV_GROUP_SIZE, selector_rank=selector_rank,
        selector_top_k=selector_top_k, sliding_block_causal=False,
    )


@torch.no_grad()
def init_dflash2_parts(drafter: DFlash2Drafter) -> None:
    """Identity convolutions and a small random selector (draws from torch's global generator)."""
    layer: Any
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0  # [2, K, hidden]: tap 0 of both the input and the output kernel
            conv.kernel_projection.weight.zero_()
    selector = drafter.candidate_selector
    for tensor in (selector.hidden_projection.weight, selector.predecessor_codebook, selector.successor_codebook):
        tensor.normal_(std=SELECTOR_INIT_STD)


def dflash2_from_dflash(source: DFlashDrafter, config: DFlash2Config, *, seed: int = 0) -> DFlash2Drafter:
    """A float32 DFlash2 drafter holding every weight of the DFlash drafter `source` (same sizes), its new parts
    initialised by `init_dflash2_parts`."""
    if isinstance(source, DFlash2Drafter):
        raise ValueError("the source is already a DFlash2 drafter")
    mismatched = [f.name for f in fields(DrafterConfig)
                  if f.name != "block_size" and getattr(source.config, f.name) != getattr(config, f.name)]
    if mismatched:
        raise ValueError(f"the DFlash2 config differs from the source drafter's in {mismatched}")
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(config)
    init_dflash2_parts(drafter)
    mine = drafter.state_dict()
    theirs = source.state_dict()
    missing = sorted(set(theirs) - set(mine))
    if missing:
        raise ValueError(f"DFlash2 drafter has no place for the source's {missing[:5]}")
    with torch.no_grad():
        for name, tensor in theirs.items():
            mine[name].copy_(tensor.float())
    return drafter
