"""DFlash2 drafters: the published checkpoint layout, each new part against hand-derived values, and lossless
decoding (greedy linear and DDTree equal plain greedy; sampling with the selector's q keeps the target's
distribution).

No reference implementation runs offline (the public ones need vLLM, SGLang, TensorRT or QEfficient), so the
convolution and the selector are checked against the formulas of docs/dflash2.md computed by hand here.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dflash.config import ModelConfig
from dflash.drafter.block_conv import BlockDynamicConv
from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.loader import load_drafter
from dflash.drafter.selector import CandidateLattice, CandidateSelector, inverse_cdf
from dflash.drafter.vocab import DraftScores
from dflash.errors import ModelLoadError
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.models.model import CausalLM
from dflash.speculative.ddtree import decode_ddtree
from dflash.speculative.sampled_acceptance import speculative_sample
from dflash.speculative.selector_tree import selector_tree
from tests.spec_helpers import one_torch_thread, random_prompts, run, total_variation
from tests.tiny_models import hf_tiny, ours_from_hf

_threads = one_torch_thread  # tiny models: one intra-op thread
VOCAB = 48
HIDDEN, LAYERS, RANK, TOP_K, KERNEL, GROUP = 64, 2, 8, 6, 2, 16


def published_config(
    block: int = 4, vocab: int = VOCAB, top: dict[str, Any] | None = None, **dflash: Any
) -> dict[str, Any]:
    """A DFlash2 config.json as published: Qwen3 fields at the top, DFlash2 fields in `dflash_config`, no
    num_target_layers, rope theta under rope_parameters."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "intermediate_size": 96, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0},
        "is_causal": False, "layer_types": ["full_attention"] * LAYERS,
        "dflash_config": {"block_size": block, "mask_token_id": vocab - 1, "target_layer_ids": [1, 2],
                          "conv_kernel_size": KERNEL, "conv_group_size": GROUP, "selector_rank": RANK,
                          "selector_top_k": TOP_K, **dflash},
        **(top or {}),
    }


def published_weights(seed: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Random tensors under the published names and shapes (written out here, not taken from our modules)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    groups = HIDDEN // GROUP
    weights = {"fc.weight": rand(HIDDEN, 2 * HIDDEN, scale=0.1), "hidden_norm.weight": 1 + rand(HIDDEN, scale=0.1),
               "norm.weight": 1 + rand(HIDDEN, scale=0.1),
               "candidate_selector.hidden_projection.weight": rand(RANK, HIDDEN),
               "candidate_selector.predecessor_codebook": rand(vocab, RANK, scale=1.0),
               "candidate_selector.successor_codebook": rand(vocab, RANK, scale=1.0)}
    for n in range(LAYERS):
        p = f"layers.{n}."
        for name, shape in (("self_attn.q_proj", (64, HIDDEN)), ("self_attn.k_proj", (32, HIDDEN)),
                            ("self_attn.v_proj", (32, HIDDEN)), ("self_attn.o_proj", (HIDDEN, 64)),
                            ("mlp.gate_proj", (96, HIDDEN)), ("mlp.up_proj", (96, HIDDEN)),
                            ("mlp.down_proj", (HIDDEN, 96))):
            weights[p + name + ".weight"] = rand(*shape, scale=0.15)
        for name, size in (("self_attn.q_norm", 16), ("self_attn.k_norm", 16), ("input_layernorm", HIDDEN),
                           ("post_attention_layernorm", HIDDEN)):
            weights[p + name + ".weight"] = 1 + rand(size, scale=0.1)
        for conv in ("attention_conv", "mlp_conv"):
            weights[p + conv + ".base_kernel"] = torch.tensor([1.0, 0.5])[None, :, None] + rand(2, KERNEL, HIDDEN)
            weights[p + conv + ".kernel_projection.weight"] = rand(2 * KERNEL * groups, HIDDEN, scale=0.1)
    return weights


def tiny_target(embed_scale: float = 1.0, vocab: int = VOCAB) -> CausalLM:
    hf = hf_tiny("llama", seed=3)
    hf.resize_token_embeddings(vocab)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(embed_scale)
    hf.config.vocab_size = vocab
    return ours_from_hf(hf)


def write_drafter(folder: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


# the published drafters' attention: sliding layers, non-causal inside the block (window 8: prompts reach past it)
SLIDING = {"layer_types": ["sliding_attention"] * LAYERS, "sliding_window": 8, "is_causal": False}


def tiny_pair(
    tmp_path: Path, embed_scale: float = 1.0, seed: int = 0, vocab: int = VOCAB, top: dict[str, Any] | None = None
) -> tuple[CausalLM, DFlash2Drafter]:
    target = tiny_target(embed_scale, vocab)
    config = published_config(vocab=vocab, top=top)
    folder = write_drafter(tmp_path / "drafter", config, published_weights(seed, vocab))
    drafter = load_drafter(str(folder), target.config)
    assert isinstance(drafter, DFlash2Drafter)
    return target, drafter


# --- loading ---------------------------------------------------------------------------------------------------


def test_published_checkpoint_loads_as_dflash2_with_every_tensor(tmp_path: Path) -> None:
    target = tiny_target()
    weights = published_weights(1)
    drafter = load_drafter(str(write_drafter(tmp_path / "d", published_config(), weights)), target.config)
    assert isinstance(drafter, DFlash2Drafter)
    config = drafter.config
    assert (config.block_size, config.conv_kernel_size, config.conv_group_size) == (4, KERNEL, GROUP)
    assert (config.selector_rank, config.selector_top_k, config.rope_theta) == (RANK, TOP_K, 10000.0)
    assert config.target_layer_ids == (1, 2)
    state = drafter.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name


def test_block_size_in_dflash_config_wins_and_default_is_read() -> None:
    raw = published_config(block=8)
    raw["block_size"] = 16  # a top-level value loses to dflash_config's
    assert DFlash2Config.from_dict(raw).block_size == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"selector_rank": None}, "selector_rank"),
        ({"conv_group_size": 24}, "not a multiple of conv_group_size"),
        ({"selector_top_k": 0}, "selector_top_k 0 < 1"),
        ({"output_multiplier": 2.0}, "output_multiplier"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ],
)
def test_bad_configs_are_refused_clearly(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    folder = write_drafter(tmp_path / "d", published_config(**change), published_weights(0))
    with pytest.raises(ModelLoadError, match=message):
        load_drafter(str(folder), tiny_target().config)


def test_wrong_codebook_shape_and_missing_conv_are_refused(tmp_path: Path) -> None:
    config = tiny_target().config
    weights = published_weights(0)
    weights["candidate_selector.successor_codebook"] = torch.zeros(VOCAB, RANK + 1)
    with pytest.raises(ModelLoadError, match="successor_codebook has shape"):
        load_drafter(str(write_drafter(tmp_path / "a", published_config(), weights)), config)
    weights = published_weights(0)
    del weights["layers.1.mlp_conv.base_kernel"]
    with pytest.raises(ModelLoadError, match="missing"):
        load_drafter(str(write_drafter(tmp_path / "b", published_config(), weights)), config)


def test_plain_dflash_config_still_loads_as_dflash(tmp_path: Path) -> None:
    from dflash.drafter.model import DFlashDrafter

    raw = published_config()
    raw["architectures"] = ["DFlashDraftModel"]
    raw["num_target_layers"] = 4
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del raw["dflash_config"][key]
    weights = {k: v for k, v in published_weights(0).items() if "_conv" not in k and "candidate_selector" not in k}
    drafter = load_drafter(str(write_drafter(tmp_path / "d", raw, weights)), tiny_target().config)
    assert type(drafter) is DFlashDrafter


def test_is_causal_false_makes_sliding_layers_see_the_whole_block(tmp_path: Path) -> None:
    """With `is_causal: false` an early block row depends on later rows; with it unset (DFlash's rule for sliding
    layers) it does not. `is_causal: true` is refused."""
    target = tiny_target()
    features = torch.randn(1, 12, 2 * HIDDEN, generator=torch.Generator().manual_seed(0))
    changes = {}
    for name, top in (("non-causal", SLIDING), ("causal", {**SLIDING, "is_causal": None})):
        folder = write_drafter(tmp_path / name, published_config(top=top), published_weights(2))
        drafter = load_drafter(str(folder), target.config)
        assert isinstance(drafter, DFlash2Drafter) and drafter.sliding_block_causal == (name == "causal")
        embeds = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(1))
        later = embeds.clone()
        later[:, 3] += 1.0
        outputs = [drafter.draft_hidden(e, torch.arange(12, 16)[None], features, torch.arange(12)[None],
                                        drafter.new_cache(32)) for e in (embeds, later)]
        changes[name] = float((outputs[0][:, 1] - outputs[1][:, 1]).abs().max())
    assert changes["causal"] == 0.0 and changes["non-causal"] > 1e-4
    folder = write_drafter(tmp_path / "bad", published_config(top={"is_causal": True}), published_weights(2))
    with pytest.raises(ModelLoadError, match="is_causal"):
        load_drafter(str(folder), target.config)


# --- the convolution -------------------------------------------------------------------------------------------


def conv_by_hand(x: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
    """out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // GROUP]) * x[t - o, c], x before a block's start = 0."""
    rows, hidden = x.shape[1], x.shape[2]
    out = torch.zeros_like(x)
    for t in range(rows):
        for o in range(base.shape[0]):
            if t % block - o < 0:
                continue  # the tap would read the previous block
            for c in range(hidden):
                out[0, t, c] += (base[o, c] + dynamic[0, t, o, c // GROUP]) * x[0, t - o, c]
    return out


def test_convolution_matches_the_formula_and_stays_inside_each_block() -> None:
    torch.manual_seed(0)
    block = 4
    conv = BlockDynamicConv(HIDDEN, 3, GROUP, block)  # three taps: row 1 must not read row -1 either
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.2)
    x = torch.randn(1, 2 * block, HIDDEN)  # two blocks laid end to end (the training layout)
    out, kernel = conv.prepare(x)
    dynamic = conv.kernel_projection(x).view(1, 2 * block, 2, 3, HIDDEN // GROUP)
    torch.testing.assert_close(out, conv_by_hand(x, conv.base_kernel[0], dynamic[:, :, 0], block), rtol=1e-5,
                               atol=1e-5)
    y = torch.randn(1, 2 * block, HIDDEN)
    torch.testing.assert_close(conv.finish(y, kernel), conv_by_hand(y, conv.base_kernel[1], dynamic[:, :, 1], block),
                               rtol=1e-5, atol=1e-5)
    # changing the first block leaves the second block's outputs alone; row 0 of a block reads no earlier row
    changed = y.clone()
    changed[:, :block] += 5.0
    assert torch.equal(conv.finish(changed, kernel)[:, block:], conv.finish(y, kernel)[:, block:])
    first_only = torch.zeros_like(y)
    first_only[:, 0] = 1.0
    assert conv.finish(first_only, kernel)[:, 0].abs().sum() > 0
    assert conv.finish(first_only, kernel)[:, 1 + 2 :].abs().sum() == 0  # taps reach at most 2 rows forward


def test_new_convolution_is_the_identity() -> None:
    conv = BlockDynamicConv(HIDDEN, KERNEL, GROUP, 4)
    torch.nn.init.zeros_(conv.kernel_projection.weight)
    x = torch.randn(1, 4, HIDDEN)
    out, kernel = conv.prepare(x)
    assert torch.equal(out, x) and torch.equal(conv.finish(x, kernel), x)


# --- the selector ----------------------------------------------------------------------------------------------


def random_lattice(rows: int = 3, seed: int = 0) -> tuple[CandidateLattice, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK, TOP_K).requires_grad_(False)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    hidden = torch.randn(rows, HIDDEN, generator=g)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    return selector.lattice(hidden, DraftScores(logits, None, VOCAB)), hidden, logits


def test_selector_score_equals_the_formula_by_hand() -> None:
    lattice, hidden, logits = random_lattice()
    selector = lattice.selector
    # candidates are each row's top-K logits
    assert torch.equal(lattice.candidates.sort(-1).values, logits.topk(TOP_K, -1).indices.sort(-1).values)
    for row in range(lattice.rows):
        predecessor = 7 + row
        h = [sum(float(selector.hidden_projection.weight[r, c]) * float(hidden[row, c]) for c in range(HIDDEN))
             for r in range(RANK)]
        for k, b in enumerate(lattice.candidates[row].tolist()):
            pair = sum(float(selector.predecessor_codebook[predecessor, r]) * h[r]
                       * float(selector.successor_codebook[b, r]) for r in range(RANK))
            expected = float(logits[row, b]) + pair
            assert abs(float(lattice.scores(row, predecessor)[k]) - expected) < 1e-3 * (1 + abs(expected))


def test_greedy_walk_takes_the_argmax_after_each_pick() -> None:
    lattice, _, _ = random_lattice(rows=4)
    chain = lattice.walk(anchor=5)
    predecessor = 5
    for row in range(4):
        scores = lattice.scores(row, predecessor)
        assert int(chain.tokens[row]) == int(lattice.candidates[row, scores.argmax()])
        assert float(chain.q[row].sum()) == 1.0 and float(chain.q[row].max()) == 1.0  # one-hot
        predecessor = int(chain.tokens[row])


def test_pairwise_term_changes_the_pick() -> None:
    """A hand-made lattice where the top unary candidate loses to the pairwise score."""
    selector = CandidateSelector(2, 4, 1, 2).requires_grad_(False)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.tensor([[1.0, 0.0]]))
        selector.predecessor_codebook.copy_(torch.tensor([[1.0], [0.0], [0.0], [0.0]]))
        selector.successor_codebook.copy_(torch.tensor([[0.0], [0.0], [0.0], [3.0]]))
    logits = torch.tensor([[0.0, 0.0, 2.0, 1.0]])  # top-2: token 2 (U=2), token 3 (U=1)
    lattice = selector.lattice(torch.tensor([[1.0, 0.0]]), DraftScores(logits, None, 4))
    assert lattice.walk(anchor=0).tokens.tolist() == [3]  # S(0, 3) = 1 + 1*1*3 = 4 > S(0, 2) = 2
    assert lattice.walk(anchor=1).tokens.tolist() == [2]  # predecessor code 0: the unary order


def test_the_walk_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy and sampled walks keep every pick on the device (a GPU round waits for no row): no tensor is turned
    into a Python number or list inside them, and they pick what the per-row reference (`scores` with the previous
    pick, argmax or an inverse-CDF draw with the same generator) picks."""
    lattice, _, _ = random_lattice(rows=5, seed=4)
    references = []
    for temperature in (0.0, 1.5):
        g = torch.Generator().manual_seed(9)
        picks, predecessor = [], 11
        for row in range(lattice.rows):
            scores = lattice.scores(row, predecessor)
            if temperature == 0.0:
                index = int(scores.argmax())
            else:
                index = inverse_cdf(torch.softmax(scores / temperature, -1), torch.rand((), generator=g))
            predecessor = int(lattice.candidates[row, index])
            picks.append(predecessor)
        references.append(picks)

    def refused(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a tensor was read back inside the walk")

    chains = []
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, refused)
        for temperature in (0.0, 1.5):
            chains.append(lattice.walk(11, temperature, torch.Generator().manual_seed(9)))
    assert [chain.tokens.tolist() for chain in chains] == references


def test_inverse_cdf_pick_by_hand() -> None:
    q = torch.tensor([0.25, 0.0, 0.5, 0.25])  # cdf 0.25, 0.25, 0.75, 1 (exact in float32)
    for u, expected in ((0.0, 0), (0.2499, 0), (0.25, 2), (0.7499, 2), (0.75, 3), (0.99999, 3), (1.0, 3)):
        assert inverse_cdf(q, torch.tensor(u)) == expected, u


def test_sampled_walk_follows_q() -> None:
    lattice, _, _ = random_lattice(rows=1, seed=3)
    g = torch.Generator().manual_seed(0)
    temperature, draws = 2.0, 6000
    q = torch.softmax(lattice.scores(0, 11) / temperature, -1)
    counts = Counter(int(lattice.walk(11, temperature, g).tokens[0]) for _ in range(draws))
    chain = lattice.walk(11, temperature, g)
    torch.testing.assert_close(chain.q[0], q)
    expected = Counter({int(t): float(p) * draws for t, p in zip(lattice.candidates[0], q, strict=True)})
    assert total_variation(counts, expected) < 0.03
    assert set(counts) <= set(lattice.candidates[0].tolist())


# --- verification with q ---------------------------------------------------------------------------------------


def test_speculative_sampling_with_q_gives_the_target_distribution() -> None:
    """One draft drawn from q, then the rule: the first committed token is distributed as p (TV < 0.02 over 20000
    draws). The control (accept every draft) gives q instead and fails the same check."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])
    g = torch.Generator().manual_seed(1)
    draws = 20000
    drafts = torch.multinomial(q[0], draws, replacement=True, generator=g)
    counts: Counter[int] = Counter()
    for draft in drafts.tolist():
        accepted, token = speculative_sample(p, torch.tensor([draft]), q, g)
        counts[draft if accepted else token] += 1
    expected = Counter({i: float(v) * draws for i, v in enumerate(p[0])})
    assert total_variation(counts, expected) < 0.02
    assert total_variation(Counter(drafts.tolist()), expected) > 0.2  # the drafts alone are far from p


# --- decoding --------------------------------------------------------------------------------------------------


def guided_by(drafter: DFlash2Drafter, sequence: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the drafter mostly right: the token `sequence` has at a row's position gets a large unary bonus (added
    as a candidate if missing), except on every third position. The selector's own walk still picks the chain."""
    own = drafter.draft_lattice

    def draft_lattice(target: Any, pending: int, start: int, *args: Any, **kwargs: Any) -> CandidateLattice:
        lattice = own(target, pending, start, *args, **kwargs)
        candidates, unary = lattice.candidates.clone(), lattice.unary.clone()
        for row in range(lattice.rows):
            position = start + 1 + row
            if position >= len(sequence) or position % 3 == 0:
                continue
            hits = (candidates[row] == sequence[position]).nonzero()
            column = int(hits[0]) if hits.numel() else TOP_K - 1
            candidates[row, column] = sequence[position]
            unary[row, column] += 100.0
        return CandidateLattice(candidates, unary, lattice.projected, lattice.selector)

    monkeypatch.setattr(drafter, "draft_lattice", draft_lattice)


def test_greedy_linear_equals_plain_greedy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter = tiny_pair(tmp_path)
    for prompt in random_prompts(3, VOCAB - 1, seed=5, lengths=(5, 20)):  # the drafter alone: rarely right
        assert run(target, drafter, prompt, 24)[0] == run(target, None, prompt, 24)[0]
    accepted = []
    for prompt in random_prompts(3, VOCAB - 1, seed=6, lengths=(5, 20)):
        plain, _ = run(target, None, prompt, 24)
        with monkeypatch.context() as patch:
            guided_by(drafter, prompt + plain, patch)
            spec, stats = run(target, drafter, prompt, 24)
        assert spec == plain
        accepted += stats.accepted_per_round
    assert max(accepted) >= 2 and min(accepted) < 3  # multi-token rounds, and rounds cut short


def run_ddtree(
    target: CausalLM, drafter: DFlash2Drafter, prompt: list[int], max_new: int, budget: int
) -> tuple[list[int], list[int]]:
    """Greedy DDTree -> (tokens, accepted drafts per round)."""
    sampling = SamplingParams()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(sampling, eos_ids=(), min_tokens=0, vocab_size=VOCAB, device="cpu")
    stats = decode_ddtree(target, drafter, request, sink, chooser, prefill_chunk=64, budget=budget)
    return sink.token_ids, stats.accepted_per_round


def test_greedy_ddtree_from_the_selector_equals_plain_greedy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter = tiny_pair(tmp_path)
    guided_accepts: list[int] = []
    for index, prompt in enumerate(random_prompts(4, VOCAB - 1, seed=8, lengths=(6, 19))):
        plain, _ = run(target, None, prompt, 20)
        with monkeypatch.context() as patch:
            if index % 2:
                guided_by(drafter, prompt + plain, patch)
            tokens, accepted = run_ddtree(target, drafter, prompt, 20, budget=6)
        assert tokens == plain
        if index % 2:
            guided_accepts += accepted
    assert max(guided_accepts) >= 2


def test_selector_tree_is_best_first_over_conditional_log_probs() -> None:
    lattice, _, _ = random_lattice(rows=3, seed=4)
    tree = selector_tree(lattice, anchor=2, budget=5)
    assert tree.num_nodes == 5
    # the first node is the greedy walk's first pick (the best child of the root)
    assert int(tree.token_ids[0]) == int(lattice.walk(2).tokens[0])
    # every node's score (sum of conditional log-probs along its path) is at least that of any later node
    tokens = [2, *tree.token_ids.tolist()]
    parents, depths = tree.parents.tolist(), [0, *tree.depths.tolist()]
    scores = [0.0]
    for node in range(1, 6):
        parent, depth = parents[node], depths[node]
        log_probs = torch.log_softmax(lattice.scores(depth - 1, tokens[parent]), -1)
        column = lattice.candidates[depth - 1].tolist().index(tokens[node])
        scores.append(scores[parent] + float(log_probs[column]))
    assert all(scores[i] >= scores[i + 1] - 1e-6 for i in range(1, 5))
    assert selector_tree(lattice, 2, budget=100, max_depth=1).num_nodes == TOP_K  # depth limit


def _first_tokens(target: CausalLM, drafter: DFlash2Drafter | None, samples: int) -> list[Counter[int]]:
    per_position: list[Counter[int]] = [Counter() for _ in range(3)]
    for seed in range(samples):
        tokens, _ = run(target, drafter, [1, 2, 3], 3, sampling=SamplingParams(temperature=1.0, seed=seed))
        for i, token in enumerate(tokens):
            per_position[i][token] += 1
    return per_position


@pytest.mark.slow
def test_sampling_with_the_selector_keeps_the_target_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-position distributions of linear DFlash2 sampling (drafts sampled by the selector, verified with its q)
    and plain sampling agree within TV 0.06 (n=1500 each); a broken rule that accepts every draft exceeds it."""
    target, drafter = tiny_pair(tmp_path, embed_scale=2.0, vocab=8)  # few tokens: TV noise well below 0.06
    samples, tolerance = 1500, 0.06
    plain = _first_tokens(target, None, samples)
    spec = _first_tokens(target, drafter, samples)
    distances = [total_variation(p, s) for p, s in zip(plain, spec, strict=True)]
    assert max(distances) < tolerance, distances
    accepted = [a for seed in range(40) for a in run(target, drafter, [1, 2, 3], 12,
                                                     sampling=SamplingParams(temperature=1.0, seed=seed))[1]
                .accepted_per_round]
    assert max(accepted) >= 2  # the rule with q kept sampled drafts, several in a round

    import dflash.speculative.linear as linear

    def accept_all(probs: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, g: Any) -> tuple[int, int]:
        return len(drafts), int(probs[len(drafts)].argmax())

    monkeypatch.setattr(linear, "speculative_sample", accept_all)
    broken = _first_tokens(target, drafter, samples)
    assert max(total_variation(p, s) for p, s in zip(plain, broken, strict=True)) > tolerance


def test_target_fit_is_checked(tmp_path: Path) -> None:
    config = ModelConfig.from_hf(hf_tiny("llama", seed=3).config.to_dict())  # vocabulary 512, not 48
    folder = write_drafter(tmp_path / "d", published_config(), published_weights(0))
    from dflash.errors import DrafterMismatchError

    with pytest.raises(DrafterMismatchError, match="vocabulary"):
        load_drafter(str(folder), config)


# --- the batched engine core -----------------------------------------------------------------------------------


@pytest.mark.parametrize("top", [None, SLIDING], ids=["full", "sliding-non-causal"])
def test_batched_core_is_lossless_and_drafts_like_the_single_request_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, top: dict[str, Any] | None
) -> None:
    """Linear, DDTree and plain requests together in the batched core give plain greedy tokens; a lone linear
    request's rounds see the same candidates and scores there as in `decode_linear` (so the packed pass applies
    the block convolutions)."""
    from tests.batch_helpers import drain, make_core, make_sequence

    target, drafter = tiny_pair(tmp_path, top=top)
    prompts = random_prompts(3, VOCAB - 1, seed=9, lengths=(7, 23))
    core = make_core(target, drafter, max_batch=3, ddtree_budget=5, linear_drafts=3)
    seqs = [make_sequence(target, p, 16, mode) for p, mode in zip(prompts, ("linear", "ddtree", "plain"), strict=True)]
    for seq in seqs:
        core.add(seq)
    drain(core)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.error is None and seq.sink.token_ids == run(target, None, prompt, 16)[0], seq.mode

    seen: dict[str, list[CandidateLattice]] = {"loop": [], "batch": []}
    walk = CandidateLattice.walk
    for name in seen:
        def recording(self: CandidateLattice, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            seen[_name].append(self)
            return walk(self, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(CandidateLattice, "walk", recording)
            if name == "loop":
                run(target, drafter, prompts[0], 16)
            else:
                lone = make_sequence(target, prompts[0], 16, "linear")
                batch_core = make_core(target, drafter, linear_drafts=3)
                batch_core.add(lone)
                drain(batch_core)
    assert len(seen["loop"]) == len(seen["batch"]) > 1
    for single, packed in zip(seen["loop"], seen["batch"], strict=True):
        assert torch.equal(single.candidates, packed.candidates)
        torch.testing.assert_close(packed.unary, single.unary, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed.projected, single.projected, rtol=1e-4, atol=1e-4)


# --- the static round (what the GPU's graphs capture), run eagerly on the CPU ----------------------------------


@pytest.mark.parametrize("top", [None, SLIDING, {**SLIDING, "input_embedding_scale": 2.5}],
                         ids=["full", "sliding-non-causal", "embedding-scale"])
def test_static_round_and_walk_equal_the_eager_chain(tmp_path: Path, top: dict[str, Any] | None) -> None:
    """The graph runner's DFlash2 round (static buffers, key bucket, the block rule of `is_causal: false` sliding
    layers, the walk from the pending token held on the device) gives the eager `draft_chain`'s drafts, candidates
    and q, round after round, with new context rows of 1, 3 and a whole block."""
    from dflash.fastpath.runner import GraphRunner

    target, drafter = tiny_pair(tmp_path, top=top)
    runner = GraphRunner(target, drafter, capacity=256, capture=False)
    assert runner.drafter_weights is None  # the fused round has no block convolutions
    leased = runner.lease_drafter_cache(200)
    assert leased is not None
    own = drafter.new_cache(200)
    block = drafter.config.block_size
    features = torch.randn(1, 60, drafter.config.feature_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        drafter.draft_chain(target, 3, 20, features[:, :20], own)  # a first eager round on both caches
        drafter.draft_chain(target, 3, 20, features[:, :20], leased)
        for pending, new_rows in ((7, 1), (9, 3), (11, block), (2, 2)):
            start = own.length + new_rows
            rows = features[:, own.length : start]
            eager = drafter.draft_chain(target, pending, start, rows, own, num_drafts=block - 1)
            static = runner.draft_chain(pending, start, rows, leased, block - 1)
            assert static is not None
            assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.candidates, eager.candidates)
            torch.testing.assert_close(static.q, eager.q)
            assert leased.length == own.length == start
    assert runner.served == 4


def test_greedy_linear_through_the_runner_equals_plain_greedy(tmp_path: Path) -> None:
    """With a graph runner attached (its static forwards run eagerly on the CPU), DFlash2's greedy rounds are
    served by the runner's chain and the tokens stay plain greedy's."""
    from dflash.fastpath.runner import attach_graph_runner
    from dflash.generation.forwards import register_forwards

    target, drafter = tiny_pair(tmp_path, top=SLIDING)
    prompts = random_prompts(3, VOCAB - 1, seed=6, lengths=(5, 20))
    plain = [run(target, None, prompt, 24)[0] for prompt in prompts]
    runner = attach_graph_runner(target, drafter, capacity=256, capture=False)
    chains = 0
    own = runner.draft_chain

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal chains
        chain = own(*args, **kwargs)
        chains += chain is not None
        return chain

    runner.draft_chain = counted  # type: ignore[method-assign]
    rounds = 0
    try:
        for prompt, expected in zip(prompts, plain, strict=True):
            tokens, stats = run(target, drafter, prompt, 24)
            assert tokens == expected
            rounds += stats.rounds
    finally:
        register_forwards(target, None)
    # each generation's first round absorbs its whole prompt (more context rows than a block): eager
    assert rounds > len(prompts) and chains == rounds - len(prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_chain_equals_the_eager_chain_on_the_gpu(tmp_path: Path) -> None:
    """float32 on a GPU: the DFlash2 round and walk captured as one CUDA graph and replayed give the eager chain."""
    from dflash.fastpath.runner import GraphRunner

    target, drafter = tiny_pair(tmp_path, top=SLIDING)
    target, drafter = target.to("cuda"), drafter.to("cuda")
    runner = GraphRunner(target, drafter, capacity=256)
    leased = runner.lease_drafter_cache(200)
    assert leased is not None
    own = drafter.new_cache(200)
    block = drafter.config.block_size
    features = torch.randn(1, 60, drafter.config.feature_size, generator=torch.Generator().manual_seed(4)).cuda()
    with torch.inference_mode():
        drafter.draft_chain(target, 3, 20, features[:, :20], own)
        drafter.draft_chain(target, 3, 20, features[:, :20], leased)
        for pending, new_rows in ((7, 1), (9, 3), (11, block), (2, 2), (5, 1)):
            start = own.length + new_rows
            rows = features[:, own.length : start]
            eager = drafter.draft_chain(target, pending, start, rows, own, num_drafts=block - 1)
            graphed = runner.draft_chain(pending, start, rows, leased, block - 1)
            assert graphed is not None
            assert torch.equal(graphed.tokens, eager.tokens)
            torch.testing.assert_close(graphed.q, eager.q)
    assert runner.captured >= 1 and runner.served == 5
