"""The two-pass argmax program (`dflash.kernels.triton_argmax`) against torch.argmax."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels.triton_argmax import CHUNK, fast_argmax
from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")


@needs_triton
@pytest.mark.parametrize("rows", [1, 15, 40])
@pytest.mark.parametrize("width", [49152, CHUNK * 3 + 17, 100])
def test_fast_argmax_matches_torch(rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows * 7 + width)
    logits = torch.randn((rows, width), generator=generator).to(DEVICE)
    assert torch.equal(fast_argmax(logits), logits.argmax(dim=-1))


@needs_triton
def test_ties_resolve_to_the_first_index_across_pieces() -> None:
    """The maximum appears several times, inside one piece and in pieces after it: the lowest index wins, as with
    torch.argmax; a row slice with a row stride (the runner's logits[0, :rows]) reads the right rows."""
    width = CHUNK * 4
    logits = torch.zeros((3, width))
    logits[0, [CHUNK + 5, CHUNK + 9, 3 * CHUNK]] = 2.0
    logits[1, [width - 1, 7]] = 1.5
    logits[2] = -1.0  # the whole row ties: index 0
    padded = torch.zeros((1, 5, width))
    padded[0, :3] = logits
    rows = padded.to(DEVICE)[0, :3]
    assert fast_argmax(rows).tolist() == [CHUNK + 5, 7, 0]
    assert torch.equal(fast_argmax(rows), rows.argmax(dim=-1))


@needs_triton
def test_bfloat16_logits() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn((16, 49152), generator=generator).to(DEVICE, torch.bfloat16)  # many ties after rounding
    assert torch.equal(fast_argmax(logits), logits.argmax(dim=-1))


def test_without_the_program_it_is_torch_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.randn(4, 300)
    if not logits.is_cuda:
        assert torch.equal(fast_argmax(logits), logits.argmax(dim=-1))
