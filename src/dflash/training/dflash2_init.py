"""Starting points for training a DFlash2 drafter: its config, and its new parts initialised so that it starts out
computing what the DFlash drafter under it computes.

A DFlash2 drafter is a DFlash drafter plus two block convolutions per layer and a candidate selector
(`dflash.drafter.dflash2`). New parts start neutral:

- each convolution is the identity: in `out[t, c] = sum_o (base[o, c] + dynamic[t, o, g]) * x[t - o, c]` the base
  kernel's tap 0 is 1 and its other taps 0, and the dynamic projection is zero (so `dynamic` is zero whatever the
  input, while its gradient is not: it is linear in the projection);
- the selector's predecessor codebook A and hidden projection H are small random and its successor codebook B is
  zero, so the pairwise term `<A[a] * H(h), B[b]>` is exactly zero and the selector's walk starts as the unary top-1
  chain. B's gradient, `A[a] * H(h)` times the loss's, is not zero, so the first step moves B and the later ones
  all three (a LoRA-like start). Small random values in all three factors instead (std 0.02) left pairwise terms
  of about 0.01 on the default model's drafter, enough to flip near-tied candidates: the unary chain's replayed
  acceptance 2.91 became 2.85 (6 HumanEval prompts, 96 tokens, block 16).

So a DFlash2 drafter made from a trained DFlash drafter (`dflash2_from_dflash`) drafts exactly what its source
drafts at the same block size, at the start of training.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.errors import DFlashError

# the published DFlash2 layout (docs/dflash2.md)
DFLASH2_BLOCK_SIZE = 8
CONV_KERNEL_SIZE = 2
CONV_GROUP_SIZE = 16
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
# spread of the selector's random factors (A and H) at the start; B starts at zero
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
        raise DFlashError(f"a DFlash2 drafter needs a hidden size that is a multiple of {CONV_GROUP_SIZE} (the "
                          f"convolution's group), not {base.hidden_size}")
    shared: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(DrafterConfig)}
    shared["block_size"] = block_size
    return DFlash2Config(
        **shared, conv_kernel_size=CONV_KERNEL_SIZE, conv_group_size=CONV_GROUP_SIZE, selector_rank=selector_rank,
        selector_top_k=selector_top_k, sliding_block_causal=False,
    )


@torch.no_grad()
def init_dflash2_parts(drafter: DFlash2Drafter) -> None:
    """Identity convolutions and a selector whose pairwise term is zero but trainable (draws from torch's global
    generator)."""
    layer: Any
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0  # [2, K, hidden]: tap 0 of both the input and the output kernel
            conv.kernel_projection.weight.zero_()
    selector = drafter.candidate_selector
    selector.hidden_projection.weight.normal_(std=SELECTOR_INIT_STD)
    selector.predecessor_codebook.normal_(std=SELECTOR_INIT_STD)
    selector.successor_codebook.zero_()


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
