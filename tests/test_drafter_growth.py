"""Growing a drafter deeper and wider keeps what it computes, so training can continue from it."""

from __future__ import annotations

import pytest
import torch

from dflash.drafter.model import DFlashDrafter
from dflash.models.model import CausalLM
from dflash.training.growth import grow_drafter
from dflash.training.objective import build_blocks
from tests.spec_helpers import golden_pair


def _block_hidden(target: CausalLM, drafter: DFlashDrafter) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, target.config.vocab_size, (2, 40), generator=g)
    trained = torch.zeros_like(ids, dtype=torch.bool)
    trained[:, 10:] = True
    anchors = [torch.tensor([12, 20, 31]), torch.tensor([15, 25])]
    config = drafter.config
    blocks = build_blocks(ids, trained, anchors, block_size=config.block_size, mask_token_id=config.mask_token_id,
                          gamma=1.0)
    with torch.no_grad():
        features = target(ids, capture=config.target_layer_ids, logits="none").features
        return drafter.forward_blocks(target.embed(blocks.block_ids), blocks.block_positions, features, blocks.mask)


def test_grown_drafter_computes_the_same_blocks() -> None:
    target, drafter = golden_pair()
    old = drafter.config
    grown = grow_drafter(drafter, target, layers=old.num_layers + 2, intermediate_size=old.intermediate_size * 2)
    assert grown.config.num_layers == old.num_layers + 2 and grown.config.intermediate_size == 2 * old.intermediate_size
    assert len(grown.config.layer_types) == old.num_layers + 2
    torch.testing.assert_close(_block_hidden(target, grown), _block_hidden(target, drafter), rtol=1e-5, atol=1e-5)
    # the new parts are trainable, not dead: their gate/up rows are not all zero
    assert grown.layers[-1].mlp.gate_proj.weight.abs().sum() > 0
    assert grown.layers[0].mlp.gate_proj.weight[old.intermediate_size :].abs().sum() > 0


def test_a_drafter_cannot_shrink() -> None:
    target, drafter = golden_pair()
    with pytest.raises(ValueError, match="only grow"):
        grow_drafter(drafter, target, layers=drafter.config.num_layers, intermediate_size=1)
