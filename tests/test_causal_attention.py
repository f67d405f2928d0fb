"""The causal marker (SDPA's causal kernels, no materialised mask) against the position-built mask."""

from __future__ import annotations

import pytest
import torch

from dflash.models import model as model_module
from dflash.models.layers import CAUSAL
from tests.tiny_models import hf_tiny, ours_from_hf


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_causal_marker_equals_the_position_mask(family: str) -> None:
    model = ours_from_hf(hf_tiny(family))
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(3, 40)
    with torch.inference_mode():
        reference = model(ids, capture=(1, 2))
        full, sliding = model._masks(positions, positions, None)
        x, features = model.run_layers(ids, positions, CAUSAL, sliding, None, (1, 2))
        out = model.finish(x, features, "all")
    assert full is not None  # the CPU forward above used the materialised mask
    assert reference.logits is not None and out.logits is not None
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.features, reference.features, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_forward_on_the_gpu_uses_causal_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ours_from_hf(hf_tiny("qwen3")).to("cuda")
    ids = torch.randint(0, model.config.vocab_size, (4, 300), device="cuda")
    with torch.inference_mode():
        causal = model(ids, capture=(0, 3))
        monkeypatch.setattr(model_module, "CAUSAL_KERNELS", False)
        masked = model(ids, capture=(0, 3))
    torch.testing.assert_close(causal.features, masked.features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(causal.logits, masked.logits, rtol=1e-4, atol=1e-4)
