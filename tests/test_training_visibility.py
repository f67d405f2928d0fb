"""The training forward sees only what a decoding round will see: no block reads the future.

A block anchored at a may use target features of positions < a and its own block; changing every token from a
cut onwards (which changes the features there) must leave the logits of blocks anchored before the cut
unchanged, on every device and precision training runs with (bf16 autocast and fused attention on CUDA).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.training.objective import sample_anchors
from dflash.training.trainer import DrafterTrainer, TrainSettings, init_drafter, new_drafter_config
from tests.tiny_models import ours_from_hf

VOCAB = 512


def _trainer(device: str, tmp: Path) -> DrafterTrainer:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=192, intermediate_size=256, num_hidden_layers=4, num_attention_heads=3,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
    )
    target = ours_from_hf(transformers.LlamaForCausalLM(config).eval()).to(device)
    drafter_config = new_drafter_config(target, layers=2, block_size=8, mask_token_id=VOCAB - 1)
    drafter = init_drafter(drafter_config, target, from_target_layers=True, seed=0).to(device)
    return DrafterTrainer(target, drafter, [], TrainSettings(batch_size=4), out_dir=tmp)


def _check_no_lookahead(device: str, tmp: Path) -> None:
    trainer = _trainer(device, tmp)
    g = torch.Generator().manual_seed(3)
    batch, seq, prompt = 4, 300, 40
    ids = torch.randint(0, VOCAB - 1, (batch, seq), generator=g).to(device)
    trained = torch.zeros((batch, seq), dtype=torch.bool, device=device)
    trained[:, prompt:] = True
    anchors = [sample_anchors(row, 24, g) for row in trained]
    cut = 170
    changed = ids.clone()
    changed[:, cut:] = torch.randint(0, VOCAB - 1, (batch, seq - cut), generator=g).to(device)
    with torch.no_grad():
        before, blocks, _ = trainer.block_logits(ids, trained, anchors)
        after, _, _ = trainer.block_logits(changed, trained, anchors)
    block = trainer.drafter.config.block_size
    anchor_of = blocks.block_positions.view(batch, -1, block)[:, :, 0]  # [batch, blocks]
    early = anchor_of < cut
    late = (anchor_of > cut) & (blocks.labels.view(batch, -1, block)[:, :, 1] >= 0)
    assert bool(early.any()) and bool(late.any())
    difference = (before.float() - after.float()).abs().amax(-1).view(batch, -1, block).amax(-1)  # [batch, blocks]
    scale = before.float().abs().amax().item()
    assert difference[early].max().item() <= 1e-3 * scale  # blocks before the cut cannot tell
    assert difference[late].min().item() > 1e-2 * scale  # the check can fail: later blocks do change


def test_blocks_do_not_see_the_future_on_cpu(tmp_path: Path) -> None:
    _check_no_lookahead("cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_do_not_see_the_future_on_cuda(tmp_path: Path) -> None:
    _check_no_lookahead("cuda", tmp_path)
