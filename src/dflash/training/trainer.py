"""Drafter training loop: frozen target, frozen shared embedding/LM head, AdamW with warm-up and cosine decay.

Each invocation trains until `steps` or a wall-clock budget, saving a resumable checkpoint (drafter,
optimizer, step, loss history) so long runs can be split across short sessions. The loss curve is saved as PNG.
A DFlash2 drafter adds its selector's loss (`dflash.training.selector_objective`) to the block loss.
"""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig, default_target_layer_ids
from dflash.drafter.selector import CandidateSelector
from dflash.errors import DFlashError
from dflash.host_copies import to_device
from dflash.models.model import CausalLM
from dflash.progress import progress_bar
from dflash.training.objective import (
    BlockBatch,
    acceptance_estimate,
    build_blocks,
    sample_anchors,
    teacher_logits_for_blocks,
    weighted_block_loss,
)
from dflash.training.selector_objective import selector_acceptance_estimate, selector_loss, selector_terms


@dataclass
class TrainSettings:
    steps: int = 3000
    batch_size: int = 16
    max_length: int = 768
    anchors_per_sequence: int = 48
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    distill: float = 0.0  # weight of KL to the target's distribution (0 = hard labels only)
    selector_loss_weight: float = 1.0  # DFlash2: weight of the selector's loss added to the block loss
    seed: int = 0
    log_every: int = 25
    checkpoint_every_s: float = 120.0
    validation: int = 0  # examples held out of training for the validation estimate (0 = none)
    validate_every: int = 100


@dataclass
class TrainHistory:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    est_acceptance: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_acceptance: list[float] = field(default_factory=list)
    # DFlash2 only: the selector's loss and its greedy chain's acceptance estimate (empty for DFlash)
    selector_loss: list[float] = field(default_factory=list)
    selector_acceptance: list[float] = field(default_factory=list)
    val_selector_loss: list[float] = field(default_factory=list)
    val_selector_acceptance: list[float] = field(default_factory=list)


def new_drafter_config(
    target: CausalLM,
    *,
    layers: int,
    block_size: int,
    mask_token_id: int,
    num_features: int | None = None,
    intermediate_size: int | None = None,
) -> DrafterConfig:
    """A drafter shaped like one target layer per drafter layer (hidden size and heads of the target; the MLP
    width may differ)."""
    t = target.config
    return DrafterConfig(
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(default_target_layer_ids(t.num_layers, num_features or layers)),
        num_target_layers=t.num_layers,
        hidden_size=t.hidden_size,
        intermediate_size=intermediate_size or t.intermediate_size,
        num_layers=layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings,
        layer_types=("full_attention",) * layers,
    )


def init_drafter(config: DrafterConfig, target: CausalLM, *, from_target_layers: bool, seed: int) -> DFlashDrafter:
    """Random init (N(0, 0.02) matrices, unit norms); optionally copy the target's last layers' matrices.
    A `DFlash2Config` gives a DFlash2 drafter whose convolutions start as the identity and whose selector's pairwise
    term starts at zero (`init_dflash2_parts`)."""
    from dflash.training.dflash2_init import init_dflash2_parts

    torch.manual_seed(seed)
    drafter = DFlash2Drafter(config) if isinstance(config, DFlash2Config) else DFlashDrafter(config)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    if isinstance(drafter, DFlash2Drafter):
        init_dflash2_parts(drafter)
    if from_target_layers and target.config.architecture in ("llama", "qwen3"):
        t = target.config
        q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
        source_layers = list(target.layers)[-config.num_layers :]
        with torch.no_grad():
            mine: Any
            theirs: Any
            for mine, theirs in zip(drafter.layers, source_layers, strict=True):
                qw, kw, vw = theirs.self_attn.qkv_proj.weight.float().split((q, kv, kv))
                mine.self_attn.q_proj.weight.copy_(qw)
                mine.self_attn.k_proj.weight.copy_(kw)
                mine.self_attn.v_proj.weight.copy_(vw)
                mine.self_attn.o_proj.weight.copy_(theirs.self_attn.o_proj.weight.float())
                gate, up = theirs.mlp.gate_up_proj.weight.float().split(t.intermediate_size)
                width = min(t.intermediate_size, config.intermediate_size)  # a wider MLP keeps random extra units
                mine.mlp.gate_proj.weight[:width].copy_(gate[:width])
                mine.mlp.up_proj.weight[:width].copy_(up[:width])
                mine.mlp.down_proj.weight[:, :width].copy_(theirs.mlp.down_proj.weight.float()[:, :width])
                mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight.float())
                mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight.float())
            drafter.norm.weight.copy_(target.norm.weight.float())
    return drafter


def learning_rate(step: int, settings: TrainSettings) -> float:
    warmup = max(1, int(settings.steps * settings.warmup_fraction))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class DrafterTrainer:
    def __init__(
        self,
        target: CausalLM,
        drafter: DFlashDrafter,
        examples: list[tuple[list[int], list[int]]],
        settings: TrainSettings,
        out_dir: Path,
    ) -> None:
        self.target, self.drafter, self.settings, self.out_dir = target, drafter, settings, out_dir
        self.device = target.embed_tokens.weight.device
        usable = [ex for ex in examples if len(ex[1]) >= 2]
        held = set(random.Random(settings.seed).sample(range(len(usable)), min(settings.validation, len(usable) // 2)))
        self.examples = [ex for i, ex in enumerate(usable) if i not in held]
        self.validation = [usable[i] for i in sorted(held)]
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
        )
        self.step = 0
        self.history = TrainHistory()
        self.checkpoint_path = out_dir / "checkpoint.pt"

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "history": asdict(self.history),
            "settings": asdict(self.settings),
            "drafter_config": self.drafter.config.to_dict(),
        }
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)
        (self.out_dir / "history.json").write_text(json.dumps(asdict(self.history)) + "\n")

    def try_resume(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        state = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        saved = state["drafter_config"].get("architectures")
        mine = self.drafter.config.to_dict()["architectures"]
        if saved != mine:
            raise DFlashError(f"{self.checkpoint_path} holds a {saved} drafter, not a {mine} one: resume it with "
                              "the architecture it was started with (--arch)")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.history = TrainHistory(**state["history"])
        return True

    # ---- one step ----------------------------------------------------------------------------------------
    def _batch(self, rng: random.Random, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        picks = [self.examples[rng.randrange(len(self.examples))] for _ in range(self.settings.batch_size)]
        return self._tensors(picks, generator)

    def _tensors(self, picks: list[tuple[list[int], list[int]]], generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(ids [batch, longest], trained [batch, longest], anchors per row): prompt + answer cut at max_length,
        right-padded, on the device; the anchors are drawn on the host (no read-back from the device)."""
        seqs = [(p + r)[: self.settings.max_length] for p, r in picks]
        longest = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), longest), dtype=torch.long)
        trained = torch.zeros((len(seqs), longest), dtype=torch.bool)
        for row, ((prompt, _), seq) in enumerate(zip(picks, seqs, strict=True)):
            ids[row, : len(seq)] = torch.tensor(seq)
            trained[row, len(prompt) : len(seq)] = True
        anchors = [sample_anchors(row, self.settings.anchors_per_sequence, generator) for row in trained]
        return to_device(ids, self.device), to_device(trained, self.device), anchors

    @property
    def selector(self) -> CandidateSelector | None:
        """The DFlash2 drafter's candidate selector (None for DFlash: no selector loss)."""
        return self.drafter.candidate_selector if isinstance(self.drafter, DFlash2Drafter) else None

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Means over the held-out examples, with fixed anchors: `loss` (the block loss), `est_acceptance`
        (teacher-forced acceptance estimate) and for DFlash2 `selector_loss` and `selector_acceptance`."""
        generator = torch.Generator().manual_seed(self.settings.seed + 1)
        sums: dict[str, float] = {}
        total = 0.0
        self.drafter.eval()
        for lo in range(0, len(self.validation), self.settings.batch_size):
            ids, trained, anchors = self._tensors(self.validation[lo : lo + self.settings.batch_size], generator)
            _, metrics = self.objective(ids, trained, anchors, distill=0.0)
            weight = float(ids.shape[0])
            for name in ("loss", "est_acceptance", "selector_loss", "selector_acceptance"):
                if name in metrics:
                    sums[name] = sums.get(name, 0.0) + weight * float(metrics[name].item())
            total += weight
        self.drafter.train()
        return {name: value / total for name, value in sums.items()}

    def autocast(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def block_logits(
        self, ids: torch.Tensor, trained: torch.Tensor, anchors: list[torch.Tensor], *, teacher: bool = False
    ) -> tuple[torch.Tensor, BlockBatch, torch.Tensor | None]:
        """ids, trained: [batch, seq]; anchors: per row [n] -> (drafter logits [batch, blocks*B, vocab], the
        blocks, the target's logits per block slot [batch, blocks*B, vocab] when `teacher`)."""
        _, logits, blocks, teacher_logits = self.block_forward(ids, trained, anchors, teacher=teacher)
        return logits, blocks, teacher_logits

    def block_forward(
        self, ids: torch.Tensor, trained: torch.Tensor, anchors: list[torch.Tensor], *, teacher: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, BlockBatch, torch.Tensor | None]:
        """`block_logits` with the final-normed drafter hidden [batch, blocks*B, hidden] in front (the selector
        reads it)."""
        config = self.drafter.config
        with torch.no_grad(), self.autocast():
            target_out = self.target(ids, capture=config.target_layer_ids, logits="all" if teacher else "none")
        features = target_out.features
        assert features is not None
        blocks = build_blocks(
            ids, trained, anchors, block_size=config.block_size, mask_token_id=config.mask_token_id,
            gamma=self.settings.gamma,
        )
        teacher_logits = None
        if teacher:
            assert target_out.logits is not None
            teacher_logits = teacher_logits_for_blocks(target_out.logits, blocks)
        del target_out
        with self.autocast():
            embeds = self.target.embed(blocks.block_ids)
            hidden = self.drafter.forward_blocks(embeds, blocks.block_positions, features.float(), blocks.mask)
            logits = self.target.project_logits(hidden.to(self.target.lm_head.weight.dtype))
        return hidden, logits, blocks, teacher_logits

    def objective(
        self, ids: torch.Tensor, trained: torch.Tensor, anchors: list[torch.Tensor], *, distill: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to minimise on one batch and its metrics (0-dim tensors): `loss` (the block loss), `accuracy`,
        `est_acceptance`; for DFlash2 the block loss plus `selector_loss_weight` x `selector_loss`, and
        `selector_acceptance`, the estimate for the selector's greedy chain."""
        hidden, logits, blocks, teacher = self.block_forward(ids, trained, anchors, teacher=distill > 0)
        loss, metrics = weighted_block_loss(logits, blocks, teacher, distill)
        block_size = self.drafter.config.block_size
        metrics["loss"] = loss.detach()
        metrics["est_acceptance"] = acceptance_estimate(logits, blocks, block_size)
        selector = self.selector
        if selector is not None:
            with self.autocast():
                terms = selector_terms(selector, hidden, logits, ids, blocks)
            chosen = selector_loss(terms, blocks)
            metrics["selector_loss"] = chosen.detach()
            metrics["selector_acceptance"] = selector_acceptance_estimate(terms, blocks, block_size)
            loss = loss + self.settings.selector_loss_weight * chosen
        return loss, metrics

    def train_step(self, rng: random.Random, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """One optimiser step; its metrics stay on the device (0-dim tensors) until the loop logs them, so the host
        queues the next step while the device runs this one."""
        ids, trained, anchors = self._batch(rng, generator)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, self.settings)
        loss, metrics = self.objective(ids, trained, anchors, distill=self.settings.distill)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        return metrics

    # ---- the loop ----------------------------------------------------------------------------------------
    def train(self, max_minutes: float | None = None) -> TrainHistory:
        settings = self.settings
        deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
        last_save = time.monotonic()
        self.drafter.train()
        window: list[dict[str, torch.Tensor]] = []
        with progress_bar("training drafter", settings.steps) as bar:
            bar.advance(self.step)
            while self.step < settings.steps:
                if deadline is not None and time.monotonic() > deadline:
                    break
                rng = random.Random(settings.seed * 1_000_003 + self.step)
                generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + self.step)
                window.append(self.train_step(rng, generator))
                self.step += 1
                if self.step % settings.log_every == 0 or self.step == settings.steps:
                    mean = {k: float(torch.stack([m[k] for m in window]).float().mean().item()) for k in window[0]}
                    window.clear()
                    bar.advance(settings.log_every, self._record(mean))
                if self.validation and (self.step % settings.validate_every == 0 or self.step == settings.steps):
                    held_out = self.validate()
                    history = self.history
                    history.val_steps.append(self.step)
                    history.val_loss.append(held_out["loss"])
                    history.val_acceptance.append(held_out["est_acceptance"])
                    if "selector_loss" in held_out:
                        history.val_selector_loss.append(held_out["selector_loss"])
                        history.val_selector_acceptance.append(held_out["selector_acceptance"])
                if time.monotonic() - last_save > settings.checkpoint_every_s:
                    self.save_checkpoint()
                    last_save = time.monotonic()
        self.drafter.eval()
        self.save_checkpoint()
        plot_history(self.history, self.out_dir / "loss.png")
        return self.history

    def _record(self, mean: dict[str, float]) -> str:
        """Append one logging window's means to the history; the progress note for it."""
        history = self.history
        history.steps.append(self.step)
        history.loss.append(mean["loss"])
        history.accuracy.append(mean["accuracy"])
        history.est_acceptance.append(mean["est_acceptance"])
        note = f"loss {mean['loss']:.3f} acc {mean['accuracy']:.3f} tau~{mean['est_acceptance']:.2f}"
        if "selector_loss" in mean:
            history.selector_loss.append(mean["selector_loss"])
            history.selector_acceptance.append(mean["selector_acceptance"])
            note += f" selector loss {mean['selector_loss']:.3f} tau~{mean['selector_acceptance']:.2f}"
        if history.val_steps:
            note += f" | held out loss {history.val_loss[-1]:.3f} tau~{history.val_acceptance[-1]:.2f}"
            if history.val_selector_acceptance:
                note += f" selector tau~{history.val_selector_acceptance[-1]:.2f}"
        return note


def plot_history(history: TrainHistory, path: Path) -> None:
    if not history.steps:
        return
    try:
        import matplotlib
    except ImportError:  # plotting is optional (history.json keeps the numbers)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(history.steps, history.loss)
    left.set_xlabel("step")
    left.set_ylabel("weighted block cross-entropy")
    left.set_title("training loss")
    right.plot(history.steps, history.est_acceptance, color="tab:green", label="training batches")
    if history.selector_acceptance:  # DFlash2: the selector's chain beside the unary top-1 chain
        left.plot(history.steps, history.selector_loss, color="tab:purple", label="selector")
        left.legend()
        right.plot(history.steps, history.selector_acceptance, color="tab:purple", label="selector, training")
        right.legend()
    if history.val_steps:
        left.plot(history.val_steps, history.val_loss, color="tab:orange", label="held out")
        left.legend()
        right.plot(history.val_steps, history.val_acceptance, color="tab:orange", label="held out")
        if history.val_selector_acceptance:
            right.plot(history.val_steps, history.val_selector_acceptance, color="tab:red", label="selector, held out")
        right.legend()
    right.set_xlabel("step")
    right.set_ylabel("estimated acceptance length")
    right.set_title("teacher-forced acceptance estimate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
