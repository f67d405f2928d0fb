"""DDTree speculative decoding: draft a block once, verify a *tree* of continuations in one target pass.

Per round (batch of one), with the same drafter and bookkeeping as linear DFlash (:mod:`dflash.speculative.linear`):
  1. the drafter reads the features of the newly committed positions and gives logits for the B-1 positions
     after `pending` (the block [pending, MASK x (B-1)]);
  2. :func:`~dflash.speculative.tree.build_tree` picks the `budget` most likely token prefixes (root = `pending`);
  3. the target runs [root, nodes...] at positions start + depth in ONE forward, every row seeing the committed
     prefix (cache slots [0, start)) plus its own ancestors and itself, capturing features;
  4. the target chooses a token at every node (argmax at temperature 0, one independent sample per node
     otherwise); the walk from the root follows a child only while the target's choice at the current node is
     that child's token; commit the visited nodes' tokens and the choice at the last visited node (bonus);
  5. the target cache keeps only the visited rows, moved to slots start, start+1, ... (`KVCache.compact`; the
     bonus has no K/V yet), and the captured features of the visited rows (root first) become the drafter's next
     context rows, so drafter and target lengths move in step exactly as in linear decoding.

Lossless: every committed token is the target's own choice (or an independent sample of the target's
distribution) given the committed prefix, because a node's row sees exactly the committed prefix and its path.
A root-only tree (budget 0) is plain decoding; a single chain is linear DFlash.

End of the generation: a round commits at most ``depth + 1`` tokens, so the tree is limited to the depth that can
still be used (``max_new_tokens - produced - 1``). This keeps every verified position below
``prompt + max_new_tokens`` (the engine's context check) and spares useless nodes in the last rounds.

Token constraints (``GenerationRequest.constraint``): every node's row is masked with what the constraint allows
after the node's path, so the walk commits exactly what plain decoding under the constraint could.

``min_tokens``: the target's choice at a depth-``d`` node decides output token ``produced + d``; while EOS is still
suppressed (``produced < min_tokens``) the rows are chosen one by one with their exact output index, otherwise in
one call (nothing to suppress), so EOS suppression matches plain decoding exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.errors import GenerationError
from dflash.generation.forwards import Forwards, forwards_for
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationStats
from dflash.generation.selection import TokenChooser
from dflash.kv.prefix_cache import PrefixCache
from dflash.models.model import CausalLM
from dflash.speculative.gate import SpeculationGate
from dflash.speculative.selector_tree import selector_tree
from dflash.speculative.session import SpecState, begin_speculation, plain_step
from dflash.speculative.tree import (
    DraftTree,
    accepted_tokens,
    build_tree,
    follow_tree,
    linear_chain_tree,
    tree_verify_inputs,
)

__all__ = ["decode_ddtree", "tree_choices"]


def tree_choices(chooser: TokenChooser, logits: torch.Tensor, tree: DraftTree, output_index: int) -> torch.Tensor:
    """The target's choice at every tree node: logits [n+1, vocab] (root first) -> tokens [n+1].

    Row ``i`` decides output token ``output_index + depth_i``. ``TokenChooser.choose`` gives row ``i`` the index
    ``output_index + i``, which only matters while EOS is suppressed (``min_tokens``); in that case the rows are
    chosen one at a time with their exact index. A token constraint masks each row along its node's path from
    the root (``TokenChooser.allowed`` with the tree's parents).
    """
    allowed = None
    if chooser.constrained:
        allowed = chooser.allowed(tree.token_ids.tolist(), tree.parents.tolist())  # [n+1, vocab]
    if chooser.min_tokens <= output_index or not chooser.has_eos or tree.num_nodes == 0:
        return chooser.choose(logits, output_index, allowed)  # [n+1]
    depths = [0, *tree.depths.tolist()]
    rows = [
        chooser.choose(logits[i : i + 1], output_index + d, None if allowed is None else allowed[i : i + 1])
        for i, d in enumerate(depths)
    ]
    return torch.cat(rows)  # [n+1]


@torch.inference_mode()
def decode_ddtree(
    target: CausalLM,
    drafter: DFlashDrafter,
    request: GenerationRequest,
    sink: OutputSink,
    chooser: TokenChooser,
    *,
    prefill_chunk: int,
    budget: int,
    draft_window: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    seed_top1_chain: bool = False,
    prefix_cache: PrefixCache | None = None,
    forwards: Forwards | None = None,
    gate: SpeculationGate | None = None,
) -> GenerationStats:
    """Generate with DDTree verification; `budget` is the number of drafted tree nodes per round (root excluded).
    `forwards` runs both models (default: the ones registered for the target). With `gate` each round speculates
    or is a plain step as its measurements say (`dflash.speculative.gate`; for synchronous devices: it times rounds
    on the host clock)."""
    if budget < 0:
        raise GenerationError(f"ddtree budget must be >= 0, got {budget}")
    forwards = forwards_for(target) if forwards is None else forwards
    device = target.embed_tokens.weight.device
    block_size = drafter.config.block_size
    layer_ids = drafter.config.target_layer_ids
    drafting = budget > 0 and block_size > 1  # otherwise every round is a plain decoding step
    # A round verifies at most budget + 1 rows after the committed prefix.
    session = begin_speculation(
        target, drafter, request, sink, chooser, prefill_chunk=prefill_chunk,
        rows_per_round=max(budget, block_size), should_stop=should_stop, forwards=forwards, prefix_cache=prefix_cache,
    )
    if isinstance(session, GenerationStats):
        return session
    state, target_cache, drafter_cache, stats = session.state, session.target_cache, session.drafter_cache, session.stats
    finished = session.finished
    # A tree of `budget` nodes is at most `budget` deep: deeper draft positions need no LM-head rows.
    draft_rows = min(block_size - 1, budget)
    # a DFlash2 drafter's tree grows from its candidate selector (`dflash.speculative.selector_tree`), eagerly
    selector = drafter if isinstance(drafter, DFlash2Drafter) else None
    resident = None
    if drafting and draft_window is None and not seed_top1_chain and selector is None and gate is None:
        resident = forwards.resident(
            target, chooser, target_cache, drafter=drafter, drafter_cache=drafter_cache, drafts=draft_rows,
            capture=tuple(layer_ids), budget=budget,
        )
    while not finished:
        if should_stop is not None and should_stop():
            sink.finish_cancelled()
            break
        if resident is not None and resident.take_over(
            state, drafter_cache, request.max_new_tokens, sink, chooser, stats, should_stop
        ):  # greedy rounds as device-resident graph replays, one queued ahead (`dflash.fastpath.resident`)
            break
        produced = len(sink.token_ids)
        # Nodes deeper than this could only yield tokens past max_new_tokens.
        max_depth = min(block_size - 1, request.max_new_tokens - produced - 1)
        gated = gate is not None and drafting and max_depth > 0
        if gated:
            assert gate is not None
            started = time.perf_counter()
            if not gate.speculate():  # a plain step this round, without a tree's bookkeeping
                state, finished = plain_step(target, forwards, state, target_cache, chooser, sink, layer_ids)
                stats.plain_steps += 1
                gate.record(False, time.perf_counter() - started, 1)
                continue
        carried: torch.Tensor | None = None
        if drafting and max_depth > 0 and selector is not None:
            lattice = selector.draft_lattice(
                target, state.pending, state.start, state.new_features, drafter_cache, window=draft_window,
                num_drafts=draft_rows,
            )
            tree = selector_tree(lattice, state.pending, budget, max_depth)
        elif drafting and max_depth > 0:
            draft = forwards.draft_scores(
                drafter, target, state.pending, state.start, state.new_features, drafter_cache, window=draft_window,
                num_drafts=draft_rows,
            )  # logits [draft_rows, shortlist or vocab]
            tree = build_tree(draft.logits[:max_depth], budget, seed_top1_chain=seed_top1_chain, token_ids=draft.ids)
        else:  # root alone (plain decoding step); the drafter has not read the pending features yet
            tree = linear_chain_tree([])
            if drafting:
                carried = state.new_features  # [1, start - drafter_cache.length, n*hidden]

        assert target_cache.length == state.start
        # past_length 0: only the tree block of the mask; every row sees the whole committed prefix anyway
        input_ids, position_ids, tree_mask = tree_verify_inputs(
            tree, state.pending, state.start, 0, device=device
        )  # [n+1], [n+1], [n+1, n+1] ancestors and self
        is_chain = tree.max_depth == tree.num_nodes  # ancestor mask == causal mask by position
        out = forwards.forward(
            target,
            input_ids[None],
            position_ids[None],
            target_cache,
            tree_mask=None if is_chain else tree_mask,
            capture=layer_ids,
        )
        assert out.logits is not None and out.features is not None
        choices = tree_choices(chooser, out.logits[0], tree, produced)  # [n+1]
        visited, bonus = follow_tree(tree, choices)
        committed = [*accepted_tokens(tree, visited), bonus]
        stats.record_round(tree.num_nodes, len(visited) - 1)

        kept = len(visited)
        if visited == list(range(kept)):  # a prefix of the block: the rows are already in place
            target_cache.crop(state.start + kept)
            path_features = out.features[:, :kept]
        else:
            rows = torch.tensor(visited, dtype=torch.long, device=device)
            target_cache.compact(state.start, rows + state.start)
            path_features = out.features[:, rows]
        if carried is not None:
            path_features = torch.cat((carried, path_features), dim=1)
        elif not drafting:
            path_features = path_features[:, :0]  # the drafter is never run: keep no features
        state = SpecState(start=state.start + kept, pending=bonus, new_features=path_features)
        chooser.observe(committed)
        finished = sink.push_many(committed)
        if gated:
            assert gate is not None
            gate.record(True, time.perf_counter() - started, len(committed))
    return session.close(sink)
