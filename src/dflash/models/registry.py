"""Architecture name -> model class, and construction of a ready model from a checkpoint."""

from __future__ import annotations

import torch

from dflash.config import ModelConfig
from dflash.models.gemma3 import Gemma3ForCausalLM
from dflash.models.gemma4 import Gemma4ForCausalLM
from dflash.models.llama import LlamaForCausalLM
from dflash.models.materialize import materialize
from dflash.models.model import CausalLM
from dflash.models.qwen3 import Qwen3ForCausalLM
from dflash.models.qwen3_5 import Qwen35ForCausalLM
from dflash.models.qwen3_5_moe import Qwen35MoeForCausalLM
from dflash.models.qwen3_moe import Qwen3MoeForCausalLM
from dflash.models.qwen3_next import Qwen3NextForCausalLM
from dflash.models.rope import Rotary
from dflash.parallel.group import TensorParallel
from dflash.parallel.layers import prepare_sums

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_5": Qwen35ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen35MoeForCausalLM,
    "gemma4": Gemma4ForCausalLM,
}


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "checkpoint",
    tensor_parallel: TensorParallel | None = None,
) -> CausalLM:
    """Instantiate the family's model on `device` without random init, load `weights`, set eval mode. With
    `tensor_parallel`, `weights` are this rank's shard (`dflash.parallel.sharding.shard_weights`)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, tensor_parallel)
    model = materialize(model, device).to(dtype)
    for module in model.modules():
        if isinstance(module, Rotary):  # buffers are not in checkpoints: compute them on the real device
            module.recompute()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights, source)
    if tensor_parallel is not None and tensor_parallel.world > 1:
        prepare_sums(model, tensor_parallel)  # the all-reduce's buffers, for the model's rows (a collective)
    return model.eval().requires_grad_(False)
