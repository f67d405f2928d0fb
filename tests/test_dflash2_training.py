"""Training DFlash2 drafters on the CPU with a tiny target: the neutral start, the training forward against the
inference pass, the selector's loss by hand, a short fit that learns, resume, export and load, and the replay of
its rounds.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from dflash.cli import main
from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.loader import load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.selector import CandidateSelector
from dflash.drafter.vocab import DraftScores
from dflash.generation.batched import generate_batch
from dflash.models.model import CausalLM
from dflash.training.dflash2_init import dflash2_config, dflash2_from_dflash
from dflash.training.growth import grow_drafter
from dflash.training.objective import BlockBatch, build_blocks
from dflash.training.replay import anchor_draft_logits, linear_rounds, replay
from dflash.training.run_drafter import drafter_from_run
from dflash.training.selector_objective import selector_acceptance_estimate, selector_loss, selector_terms
from dflash.training.trainer import DrafterTrainer, TrainSettings, init_drafter, new_drafter_config
from tests.loading_helpers import train_byte_level_tokenizer
from tests.spec_helpers import golden_pair, one_torch_thread, random_prompts, run
from tests.tiny_models import hf_tiny, ours_from_hf

_threads = one_torch_thread  # tiny models: one intra-op thread
BLOCK = 4


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return ours_from_hf(hf_tiny("llama", seed=1))  # vocab 512, hidden 64, 4 layers


def dflash_drafter(target: CausalLM, seed: int = 0) -> DFlashDrafter:
    """A DFlash drafter with random (not neutral) norms, as a trained one would have."""
    config = new_drafter_config(target, layers=2, block_size=16, mask_token_id=511)
    drafter = init_drafter(config, target, from_target_layers=True, seed=seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return drafter


def dflash2_drafter(target: CausalLM, top_k: int = 6) -> DFlash2Drafter:
    """A fresh DFlash2 drafter whose convolutions and selector are moved off their neutral start (as training
    would), so every comparison below exercises them."""
    config = dflash2_config(new_drafter_config(target, layers=2, block_size=BLOCK, mask_token_id=511),
                            block_size=BLOCK, selector_rank=8, selector_top_k=top_k)
    drafter = init_drafter(config, target, from_target_layers=True, seed=0)
    assert isinstance(drafter, DFlash2Drafter)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "_conv" in name or "candidate_selector" in name:
                param.add_(torch.randn(param.shape, generator=g) * 0.2)
    return drafter


def random_batch(target: CausalLM, anchors: list[list[int]], seq: int = 40, seed: int = 5
                 ) -> tuple[torch.Tensor, BlockBatch, torch.Tensor]:
    """(ids [batch, seq], the blocks at `anchors`, the target's features [batch, seq, n*hidden])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (len(anchors), seq), generator=g)
    trained = torch.zeros_like(ids, dtype=torch.bool)
    trained[:, 8:] = True
    blocks = build_blocks(ids, trained, [torch.tensor(a) for a in anchors], block_size=BLOCK, mask_token_id=511,
                          gamma=4.0)
    with torch.no_grad():
        features = target(ids, capture=(1, 2), logits="none").features
    assert features is not None
    return ids, blocks, features


# --- the neutral start -----------------------------------------------------------------------------------------


def test_dflash2_made_from_a_dflash_drafter_drafts_what_it_drafts(target: CausalLM) -> None:
    """Identity convolutions and a zero pairwise term: the same block hidden as the source, and the selector's
    greedy chain is each row's unary top-1."""
    source = dflash_drafter(target)
    drafter = dflash2_from_dflash(source, dflash2_config(source.config, block_size=BLOCK))
    assert drafter.config.block_size == BLOCK and drafter.config.selector_rank == 256
    state = drafter.state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.equal(state[name], tensor), name
    _, blocks, features = random_batch(target, [[10, 20, 30]])
    with torch.no_grad():
        embeds = target.embed(blocks.block_ids)
        expected = source.forward_blocks(embeds, blocks.block_positions, features, blocks.mask)
        got = drafter.forward_blocks(embeds, blocks.block_positions, features, blocks.mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lattice = drafter.draft_lattice(target, 7, 12, features[:, :12], drafter.new_cache(32))
        chain = lattice.walk(7)
        pairwise = max(float((lattice.scores(row, 7) - lattice.unary[row]).abs().max()) for row in range(3))
    assert torch.equal(chain.tokens, lattice.candidates[:, 0]) and pairwise == 0.0


def test_a_fresh_dflash2_drafter_has_neutral_new_parts(target: CausalLM) -> None:
    config = dflash2_config(new_drafter_config(target, layers=1, block_size=BLOCK, mask_token_id=511))
    drafter = init_drafter(config, target, from_target_layers=True, seed=0)
    assert isinstance(drafter, DFlash2Drafter)
    layer = drafter.layers[0]
    for conv in (layer.attention_conv, layer.mlp_conv):
        assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, 64)) and not conv.base_kernel[:, 1].any()
        assert not conv.kernel_projection.weight.any()
    selector = drafter.candidate_selector
    for tensor in (selector.predecessor_codebook, selector.hidden_projection.weight):
        assert 0.01 < float(tensor.detach().std()) < 0.03
    assert not selector.successor_codebook.any()
    # the shared parts are the target's last layer, as for DFlash
    fused = target.layers[-1].self_attn.qkv_proj.weight
    assert torch.equal(layer.self_attn.q_proj.weight, fused[:64])


def test_every_new_part_learns_from_the_neutral_start(target: CausalLM, tmp_path: Path) -> None:
    """Zero successor codebook and zero kernel projections still get gradients: after two steps (no weight decay,
    so only gradients move weights) every new tensor has moved."""
    config = dflash2_config(new_drafter_config(target, layers=1, block_size=BLOCK, mask_token_id=511),
                            block_size=BLOCK, selector_rank=8, selector_top_k=6)
    drafter = init_drafter(config, target, from_target_layers=True, seed=0)
    assert isinstance(drafter, DFlash2Drafter)
    new_parts = {name: tensor.detach().clone() for name, tensor in drafter.named_parameters()
                 if "_conv" in name or "candidate_selector" in name}
    settings = TrainSettings(steps=2, batch_size=4, max_length=40, anchors_per_sequence=6, lr=1e-3, gamma=4.0,
                             weight_decay=0.0, warmup_fraction=0.0, log_every=1)
    DrafterTrainer(target, drafter, overfit_examples(), settings, tmp_path).train()
    after = dict(drafter.named_parameters())
    unmoved = [name for name, before in new_parts.items() if torch.equal(after[name], before)]
    assert len(new_parts) == 7 and unmoved == []


def test_grown_dflash2_drafter_keeps_its_convolutions_and_selector(target: CausalLM) -> None:
    drafter = dflash2_drafter(target)
    grown = grow_drafter(drafter, target, layers=3, intermediate_size=256)
    assert isinstance(grown, DFlash2Drafter)
    assert torch.equal(grown.candidate_selector.successor_codebook, drafter.candidate_selector.successor_codebook)
    _, blocks, features = random_batch(target, [[10, 20]])
    with torch.no_grad():
        embeds = target.embed(blocks.block_ids)
        torch.testing.assert_close(grown.forward_blocks(embeds, blocks.block_positions, features, blocks.mask),
                                   drafter.forward_blocks(embeds, blocks.block_positions, features, blocks.mask),
                                   rtol=1e-5, atol=1e-5)


# --- the training forward against the inference pass -----------------------------------------------------------


def test_training_forward_equals_the_draft_pass_block_by_block(target: CausalLM) -> None:
    """Blocks laid end to end in one training forward: each one's hidden rows, candidates and teacher-forced
    selector scores equal one inference round's at its anchor (the convolution does not cross blocks)."""
    drafter = dflash2_drafter(target).eval()
    anchors = [12, 16, 27]  # the first two blocks touch: a tap crossing the boundary would show
    ids, blocks, features = random_batch(target, [anchors])
    with torch.no_grad():
        hidden = drafter.forward_blocks(target.embed(blocks.block_ids), blocks.block_positions, features, blocks.mask)
        logits = target.project_logits(hidden)
        terms = selector_terms(drafter.candidate_selector, hidden, logits, ids, blocks)
    for index, anchor in enumerate(anchors):
        rows = slice(index * BLOCK, (index + 1) * BLOCK)
        with torch.no_grad():
            block = torch.full((1, BLOCK), 511)
            block[0, 0] = ids[0, anchor]
            positions = torch.arange(anchor, anchor + BLOCK)[None]
            inference = drafter.draft_hidden(target.embed(block), positions, features[:, :anchor],
                                             torch.arange(anchor)[None], drafter.new_cache(64))
            lattice = drafter.draft_lattice(target, int(ids[0, anchor]), anchor, features[:, :anchor],
                                            drafter.new_cache(64))
        torch.testing.assert_close(hidden[0, rows], inference[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(torch.topk(logits[0, rows][1:], 6).indices, lattice.candidates)
        for row in range(BLOCK - 1):
            predecessor = int(ids[0, anchor + row])  # the true token before slot row + 1
            torch.testing.assert_close(terms.scores[0, rows][row + 1], lattice.scores(row, predecessor),
                                       rtol=1e-4, atol=1e-4)


# --- the selector's loss ---------------------------------------------------------------------------------------


def test_selector_loss_and_acceptance_by_hand() -> None:
    """One block [anchor, MASK, MASK, MASK] over a 6-token vocabulary, top 3 candidates, rank 2."""
    selector = CandidateSelector(hidden_size=2, vocab_size=6, rank=2, top_k=3)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        selector.predecessor_codebook.copy_(torch.tensor([[1, 0], [0, 1], [1, 1], [2, 0], [0, 0], [1, -1.0]]))
        selector.successor_codebook.copy_(torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0], [2, 1], [1, 2.0]]))
    ids = torch.tensor([[3, 2, 5, 0, 1, 4]])  # anchor at 1: block predicts 5, 0, 1 after the anchor token 2
    hidden = torch.tensor([[[0.0, 0.0], [0.5, 1.0], [1.0, -1.0], [2.0, 0.5]]])
    logits = torch.tensor([[[0.0] * 6,
                            [0.1, 0.2, 0.3, 0.0, 0.9, 0.8],  # top 3: 4, 5, 2 (label 5 is candidate 1)
                            [0.5, 0.1, 0.0, 0.7, 0.2, 0.0],  # top 3: 3, 0, 4 (label 0 is candidate 1)
                            [0.0, 0.0, 0.9, 0.8, 0.7, 0.6]]], requires_grad=True)  # top 3: 2, 3, 4 (label 1 absent)
    blocks = build_blocks(ids, torch.ones_like(ids, dtype=torch.bool), [torch.tensor([1])], block_size=4,
                          mask_token_id=5, gamma=2.0)
    terms = selector_terms(selector, hidden, logits, ids, blocks)

    def score(predecessor: int, candidate: int, row: int) -> float:
        a = selector.predecessor_codebook[predecessor].tolist()
        b = selector.successor_codebook[candidate].tolist()
        h = [hidden[0, row, 0].item(), 2 * hidden[0, row, 1].item()]
        return logits[0, row, candidate].item() + sum(a[r] * h[r] * b[r] for r in range(2))

    expected = {1: (2, [4, 5, 2], 1), 2: (5, [3, 0, 4], 1), 3: (0, [2, 3, 4], -1)}  # predecessor, candidates, label
    losses, weights = [], []
    for row, (predecessor, candidates, label_index) in expected.items():
        by_hand = [score(predecessor, c, row) for c in candidates]
        torch.testing.assert_close(terms.scores[0, row], torch.tensor(by_hand))
        assert int(terms.target_index[0, row]) == label_index
        if label_index >= 0:
            log_total = math.log(sum(math.exp(s) for s in by_hand))
            losses.append(log_total - by_hand[label_index])
            weights.append(math.exp(-(row - 1) / 2.0))
    assert weights[0] == 1.0 and len(losses) == 2  # row 3 (label not a candidate) is skipped
    loss = selector_loss(terms, blocks)
    assert loss.item() == pytest.approx(sum(w * v for w, v in zip(weights, losses, strict=True)) / sum(weights),
                                        rel=1e-5)
    loss.backward()
    assert logits.grad is None  # the unary scores are detached: only the selector learns from this loss
    assert selector.successor_codebook.grad is not None and selector.successor_codebook.grad.abs().sum() > 0

    # the selector's greedy walk (the inference code) picks 5 (the label; the unary top-1 is 4), then 4 (not the
    # label 0): a run of 1, which the estimate gives from the teacher-forced scores alone
    lattice = selector.lattice(hidden[0, 1:], DraftScores(logits[0, 1:].detach(), None, 6))
    assert lattice.walk(2).tokens[:2].tolist() == [5, 4]
    assert selector_acceptance_estimate(terms, blocks, 4).item() == 2.0


# --- fitting ---------------------------------------------------------------------------------------------------


def overfit_examples(count: int = 6) -> list[tuple[list[int], list[int]]]:
    """Short answers made of one repeated pattern each: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(count):
        prompt = torch.randint(0, 500, (6,), generator=g).tolist()
        pattern = torch.randint(0, 500, (5,), generator=g).tolist()
        examples.append((prompt, (pattern * 6)[:28]))
    return examples


def test_fit_learns_on_a_tiny_overfit_set(target: CausalLM, tmp_path: Path) -> None:
    """Both losses fall and both chains' acceptance estimates rise toward the block's 4 (the tiny target's tied
    LM head gives small logits, so the block cross-entropy falls slowly while the drafts become right)."""
    drafter = dflash2_drafter(target, top_k=8)
    selector_before = drafter.candidate_selector.successor_codebook.detach().clone()
    conv_before = drafter.layers[0].mlp_conv.kernel_projection.weight.detach().clone()
    settings = TrainSettings(steps=80, batch_size=4, max_length=40, anchors_per_sequence=6, lr=3e-3, gamma=4.0,
                             log_every=10, warmup_fraction=0.1)
    trainer = DrafterTrainer(target, drafter, overfit_examples(), settings, tmp_path)
    history = trainer.train()
    assert len(history.loss) == 8 and len(history.selector_loss) == 8
    assert history.loss[-1] < history.loss[0] - 0.5 and history.accuracy[-1] > 0.8
    assert history.selector_loss[-1] < 0.5 * history.selector_loss[0]
    assert history.est_acceptance[0] < 2.0 and history.est_acceptance[-1] > 3.0
    assert history.selector_acceptance[0] < 2.0 and history.selector_acceptance[-1] > 3.0
    assert not torch.equal(drafter.candidate_selector.successor_codebook, selector_before)
    assert not torch.equal(drafter.layers[0].mlp_conv.kernel_projection.weight, conv_before)  # and the convolutions


# --- the command line: fit, resume, export, load ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with a byte-level tokenizer, saved as transformers does."""
    path = tmp_path_factory.mktemp("tiny_llama")
    hf_tiny("llama", seed=1).save_pretrained(path, safe_serialization=True)
    train_byte_level_tokenizer(400).save(str(path / "tokenizer.json"))
    return path


def write_examples(path: Path, examples: list[tuple[list[int], list[int]]]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for prompt, response in examples:
            handle.write(json.dumps({"prompt_ids": prompt, "response_ids": response}) + "\n")
    return path


def dflash(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    return out


def test_cli_fits_resumes_exports_and_loads_a_dflash2_drafter(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_examples(tmp_path / "data.jsonl.gz", overfit_examples(8))
    run = tmp_path / "run"
    shared = ["train", "fit", "--model", str(model_dir), "--device", "cpu", "--data", str(data), "--out", str(run),
              "--layers", "1", "--batch-size", "2", "--anchors", "3", "--max-length", "40", "--validation", "2"]
    common = [*shared, "--arch", "dflash2", "--selector-rank", "16", "--selector-top-k", "4"]
    log = dflash(capsys, *common, "--steps", "2")
    assert "starting; DFlash2 drafter 1 layers" in log
    first = torch.load(run / "checkpoint.pt", weights_only=False)
    assert first["step"] == 2 and first["drafter_config"]["architectures"] == ["DFlash2DraftModel"]
    assert first["drafter_config"]["dflash_config"]["block_size"] == 8  # DFlash2's default block
    log = dflash(capsys, *common, "--steps", "4")
    assert "resuming at step 2" in log
    summary = json.loads(log.strip().splitlines()[-1])
    assert summary["step"] == 4 and summary["selector_acceptance"][0] >= 1.0
    history = json.loads((run / "history.json").read_text())
    assert history["val_steps"] == [2, 4] and len(history["val_selector_acceptance"]) == 2

    # resuming with the other architecture is refused, not loaded half-way
    assert main([*shared, "--steps", "6"]) == 2
    assert "--arch" in capsys.readouterr().err

    exported = tmp_path / "exported"
    dflash(capsys, "train", "export", "--run", str(run), "--out", str(exported), "--export-dtype", "float32")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size",
                                                    "selector_rank", "selector_top_k")} == {
        "block_size": 8, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 4}
    trained, _ = drafter_from_run(run)
    target = ours_from_hf(hf_tiny("llama", seed=1))
    loaded = load_drafter(str(exported), target.config)
    assert isinstance(loaded, DFlash2Drafter) and isinstance(trained, DFlash2Drafter)
    features = torch.randn(1, 12, trained.config.feature_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        chains = [d.eval().draft_chain(target, 33, 12, features, d.new_cache(32)) for d in (trained, loaded)]
        lattices = [d.draft_lattice(target, 33, 12, features, d.new_cache(32)) for d in (trained, loaded)]
    assert torch.equal(chains[0].tokens, chains[1].tokens) and chains[0].tokens.numel() == 7
    assert torch.equal(lattices[0].candidates, lattices[1].candidates)
    torch.testing.assert_close(lattices[0].projected, lattices[1].projected)


def test_cli_starts_dflash2_from_a_dflash_run(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--init-from a DFlash training run: its weights are the shared part, the new parts start neutral."""
    data = write_examples(tmp_path / "data.jsonl.gz", overfit_examples(4))
    common = ["--model", str(model_dir), "--device", "cpu", "--data", str(data), "--batch-size", "2", "--anchors",
              "2", "--max-length", "32", "--validation", "0", "--steps", "1"]
    dflash(capsys, "train", "fit", *common, "--out", str(tmp_path / "dflash"), "--layers", "1")
    source, _ = drafter_from_run(tmp_path / "dflash")
    assert type(source) is DFlashDrafter and source.config.block_size == 16
    log = dflash(capsys, "train", "fit", *common, "--out", str(tmp_path / "dflash2"), "--arch", "dflash2",
                 "--init-from", str(tmp_path / "dflash"), "--steps", "0")
    assert "DFlash2 drafter 1 layers" in log
    drafter, _ = drafter_from_run(tmp_path / "dflash2")
    assert isinstance(drafter, DFlash2Drafter) and drafter.config.block_size == 8
    assert torch.equal(drafter.fc.weight, source.fc.weight)
    assert not drafter.layers[0].attention_conv.kernel_projection.weight.any()
    # a DFlash2 drafter cannot be continued as a DFlash one (its selector would be dropped)
    assert main(["train", "fit", *common, "--out", str(tmp_path / "back"), "--init-from", str(tmp_path / "dflash2")]) == 2
    assert "train it with --arch dflash2" in capsys.readouterr().err


# --- replay (`dflash train eval`) ------------------------------------------------------------------------------


def test_replay_of_a_dflash2_drafter_equals_the_decoding_loop() -> None:
    """Linear rounds replayed from one pass equal the real loop's, whose drafts are the selector's greedy chain
    (made to differ from the unary top-1 chain here by a large selector)."""
    target, source = golden_pair()
    drafter = dflash2_from_dflash(source, dflash2_config(source.config, block_size=8, selector_rank=16,
                                                         selector_top_k=4))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
            tensor.copy_(torch.randn(tensor.shape, generator=g))
    drafter.eval().requires_grad_(False)
    prompts = random_prompts(4, 1000, seed=1008, lengths=(94, 12, 40, 70))
    answers = generate_batch(target, prompts, max_new_tokens=60, eos_ids=())
    accepted, differs = 0, False
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens, stats = run(target, drafter, prompt, 60)
        assert tokens == answer
        replayed, trees = replay(target, drafter, prompt, answer, [])
        assert replayed.acceptance_lengths == [a + 1 for a in stats.accepted_per_round] and trees == {}
        accepted += sum(stats.accepted_per_round)
        unary = linear_rounds(*anchor_draft_logits(target, drafter, prompt, answer), len(answer))
        differs = differs or unary.acceptance_lengths != replayed.acceptance_lengths
    assert accepted > 0 and differs
    with pytest.raises(ValueError, match="DFlash2"):
        replay(target, drafter, prompts[0], answers[0], [4])
