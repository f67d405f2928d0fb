"""A batched step's rounds (one per decoding request: a plain step, a linear block or a tree) and the rules that
decide how each is chosen and verified, shared by the core's kinds of step (`dflash.batch.core`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from dflash.batch.sequence import Sequence
from dflash.batch.target_pass import TargetRows
from dflash.drafter.vocab import DraftScores
from dflash.generation.selection import TokenChooser
from dflash.host_copies import to_device
from dflash.speculative.tree import DraftTree, topk_log_probs


@dataclass
class Round:
    """One decoding sequence's part of a step."""

    seq: Sequence
    kind: str  # "plain" | "linear" | "tree"
    outputs: int = 0  # draft rows asked of the drafter (0: the drafter does not run for it)
    budget: int = 0  # tree nodes (tree rounds)
    drafts: list[int] | None = None  # linear
    tree: DraftTree | None = None  # tree (plain rounds use a root-only tree)
    rows: TargetRows | None = None
    greedy: bool = False  # its choice is the plain argmax of each row (`plain_greedy`, set once per step)


@dataclass(frozen=True)
class FirstToken:
    """A prompt's first token, chosen on the device and copied back without waiting (read later in the step)."""

    seq: Sequence
    host: torch.Tensor  # [1] (pinned, from a GPU)
    event: torch.cuda.Event | None  # recorded after the copy from a GPU


def device_round(rounds: list[Round]) -> tuple[int, bool] | None:
    """(tree budget, False) where every round is a tree round of that budget, (draft count, True) where every one is
    a linear round of that many drafts (a chain on the device), else None."""
    if not rounds:
        return None
    kind = rounds[0].kind
    size = rounds[0].budget if kind == "tree" else rounds[0].outputs
    if kind not in ("tree", "linear") or size <= 0:
        return None
    if any(r.kind != kind or (r.budget if kind == "tree" else r.outputs) != size for r in rounds):
        return None
    return size, kind == "linear"


def device_choice(seq: Sequence) -> bool:
    """Whether a device round can choose `seq`'s tokens: a tree's or a chain's rows, greedy or sampled on the device
    (`dflash.batch.device_sampling`: the walk follows the sampled token, as host-built rounds do), where nothing but
    the logits and the request's seed decide them."""
    return choice_stateless(seq.chooser, seq.produced)


def drawn_plain(r: Round) -> bool:
    """Whether `r` is a sampled plain round that only its logits and seed decide: drawn with the others of its step
    (`_choices`) by the uniforms of its seed and position, as a launched plain step draws it (`_sampling_for`)."""
    seq = r.seq
    return r.kind == "plain" and not seq.chooser.params.greedy and choice_stateless(seq.chooser, seq.produced)


def plain_greedy(chooser: TokenChooser, produced: int) -> bool:
    """Whether the chooser's choice for output tokens from `produced` on is the plain argmax of each row."""
    return chooser.params.greedy and choice_stateless(chooser, produced)


def choice_stateless(chooser: TokenChooser, produced: int) -> bool:
    """Whether the chooser's choice for output tokens from `produced` on depends only on the logits and its random
    stream, not on the tokens chosen before (no constraint, no penalties, no EOS suppression left): a launched step
    can choose before the previous one's tokens are read (`dflash.batch.overlap`)."""
    return (
        chooser.constraint is None and chooser.counts is None and chooser.agreement is None
        and (chooser.min_tokens <= produced or not chooser.has_eos)
    )


def matching_prefix(drafts: list[int], choices: list[int]) -> int:
    """How many leading drafts equal the target's choices at their rows
    (`dflash.speculative.acceptance.accepted_prefix_length` on lists)."""
    accepted = 0
    for draft, choice in zip(drafts, choices, strict=False):  # one choice more than drafts: the bonus row
        if draft != choice:
            break
        accepted += 1
    return accepted


def long_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, built through numpy (torch.tensor of a Python list costs several times
    more)."""
    host = torch.from_numpy(np.fromiter(values, dtype=np.int64))
    return host if device.type == "cpu" else to_device(host, device)


def greedy_drafts(chains: list[tuple[Round, DraftScores]]) -> dict[int, list[int]]:
    """The greedy drafts of every linear round whose draft scores share one shape and columns, from one argmax and
    one host transfer (instead of one per request): {id(round): drafts}."""
    if len(chains) < 2:
        return {}
    shapes = {tuple(score.logits.shape) for _, score in chains}
    ids = {id(score.ids) for _, score in chains}
    if len(shapes) != 1 or len(ids) != 1:
        return {}
    first = chains[0][1]
    stacked = DraftScores(torch.stack([score.logits for _, score in chains]), first.ids, first.vocab_size)  # [n, k, cols]
    drafts: list[list[int]] = stacked.greedy().tolist()  # [n, k]
    return {id(r): row for (r, _), row in zip(chains, drafts, strict=True)}


def tree_candidates(trees: list[tuple[Round, DraftScores]]) -> dict[int, tuple[list[list[float]], list[list[int]]]]:
    """Per-depth top-k candidates of every tree round whose draft scores share one shape, from one top-k over all
    of them and one host transfer (instead of one per request): {id(round): (log-probabilities, token ids)}."""
    if len(trees) < 2:
        return {}
    shapes = {tuple(score.logits.shape) for _, score in trees}
    budgets = {r.budget for r, _ in trees}
    if len(shapes) != 1 or len(budgets) != 1 or any(score.ids is not None for _, score in trees):
        return {}
    stacked = torch.stack([score.logits for _, score in trees])  # [trees, depth, vocab]
    k = min(budgets.pop(), stacked.shape[-1])
    top_lp, top_ids = topk_log_probs(stacked.flatten(0, 1), k)  # [trees * depth, k]
    depth = stacked.shape[1]
    if stacked.shape[-1] <= 1 << 24:  # ids exact in float64: one transfer for both
        both = torch.stack((top_lp.double(), top_ids.double())).view(2, len(trees), depth, k).cpu()
        lp, ids = both[0].tolist(), both[1].long().tolist()
    else:
        lp = top_lp.view(len(trees), depth, k).cpu().tolist()
        ids = top_ids.view(len(trees), depth, k).cpu().tolist()
    return {id(r): (lp[i], ids[i]) for i, (r, _) in enumerate(trees)}
