"""The drafter's projections as int8 rows for the GPU's skinny program (`dflash.models.int8_linear`).

A drafter's round on a GPU reads every one of its weights once; with int8 rows and one scale per row it reads half
the bytes of bfloat16. Drafts only propose tokens: the target verifies every one, so rounding the drafter's weights
can change how many drafts are accepted, never what is generated. The target's own LM head, which a drafter without
a shortlist borrows, is left as it is; a shortlist head (`dflash.drafter.vocab`) is the drafter's and is rounded.
"""

from __future__ import annotations

from torch import nn

from dflash.drafter.model import DFlashDrafter
from dflash.models.int8_linear import Int8Linear
from dflash.models.native_parts import layers_changed

__all__ = ["quantize_drafter_int8"]


def quantize_drafter_int8(drafter: DFlashDrafter) -> int:
    """Replace every `nn.Linear` of a drafter (and of its shortlist head) by an `Int8Linear`, in place; the
    products keep the drafter's dtype (the int8 program serves 16-bit floats on a GPU; elsewhere each product widens
    its matrix). Returns how many were replaced."""
    replaced = 0
    for parent in list(drafter.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
                replaced += 1
    head = drafter.draft_head  # a shortlist head is held outside the module tree
    if head is not None and isinstance(head.rows, nn.Linear):
        head.rows = Int8Linear.from_linear(head.rows)
        replaced += 1
    layers_changed()  # a plan of the native layers describes the modules replaced
    return replaced
