"""Quick CUDA smoke test of the training step and batched generation on a tiny random model."""

import torch

from dflash.config import ModelConfig
from dflash.generation.batched import generate_batch
from dflash.models.model import CausalLM
from dflash.training.trainer import DrafterTrainer, TrainSettings, init_drafter, new_drafter_config

config = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
    tie_word_embeddings=True, layer_types=("full_attention",) * 6,
)
torch.manual_seed(0)
model = CausalLM(config).cuda().to(torch.bfloat16).eval().requires_grad_(False)
out = generate_batch(model, [[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=8, eos_ids=[0])
print("batched", out)
examples = [([1, 2, 3], list(range(10, 60))) for _ in range(8)]
drafter = init_drafter(new_drafter_config(model, layers=2, block_size=16, mask_token_id=511), model,
                       from_target_layers=True, seed=0).cuda()
trainer = DrafterTrainer(model, drafter, examples, TrainSettings(steps=20, batch_size=4, log_every=5), __import__("pathlib").Path("/tmp/smoke"))
history = trainer.train()
print("loss", history.loss, "tau", history.est_acceptance)
