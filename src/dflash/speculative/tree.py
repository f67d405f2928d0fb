"""DDTree: draft trees for block-diffusion speculative decoding, and their verification.

One drafter pass yields per-position logits for the block positions 1..D (row ``d-1`` is depth ``d``). Instead of
verifying only the greedy chain, DDTree verifies a *tree* of likely continuations in one target forward:

* :func:`build_tree` picks the ``budget`` highest-scoring token prefixes, where a prefix's score is the sum of its
  tokens' log-probabilities (a product of the per-position marginals), best-first from a max-heap.
* :func:`tree_verify_inputs` packs the tree into target inputs: ``[root, nodes...]`` at positions
  ``start + depth``, with a mask under which every node sees the committed past plus its own ancestors and itself.
* :func:`follow_tree` walks the verified tree with the target's choices ("posterior", one per node) and returns the
  accepted path and the bonus token. This is lossless for the same reason as linear DFlash verification: every
  committed token is the target's own choice given the committed prefix.

Conventions (they match the golden vectors in ``tests/data/golden/ddtree``):

* Node 0 is the root: the already chosen pending (bonus) token at position ``start``; it is not drafted. Nodes
  ``1..n`` are drafted; node ``i`` has token ``token_ids[i-1]``, depth ``depths[i-1]`` (1-based) and parent
  ``parents[i]`` (``parents[0] == -1``). A parent always has a smaller index than its children.
* Per depth only the ``K = min(budget, vocab)`` highest logits are candidates; their log-probabilities are a true
  float32 log-softmax over the whole vocabulary (not renormalised over the K).
* Nodes are numbered in the order they leave the heap (non-increasing score). Equal scores are ordered by the
  per-depth rank sequences, compared as Python tuples (smaller ranks first, a prefix before its extensions).
* ``visibility[i, j]`` is True exactly when ``j == i`` or node ``j`` is an ancestor of node ``i``.

Everything here is pure (no model, no KV cache) and runs on CPU; the only torch work on the logits' device is one
top-k and one log-sum-exp, after which the heap loop runs in Python over small lists.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "DraftTree",
    "accepted_tokens",
    "build_tree",
    "follow_tree",
    "linear_chain_tree",
    "topk_log_probs",
    "tree_from_candidates",
    "tree_from_parents",
    "tree_verify_inputs",
]


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree: the root (node 0, not stored as a token) plus ``n`` drafted nodes ``1..n``.

    ``eq=False`` keeps identity comparison/hashing: field-wise ``==`` on tensors is not a boolean.
    """

    token_ids: torch.Tensor  # [n] int64, token of node i at index i-1 (root excluded)
    depths: torch.Tensor  # [n] int64, depth of node i (1-based) at index i-1
    parents: torch.Tensor  # [n+1] int64, parent index per node, -1 for the root
    visibility: torch.Tensor  # [n+1, n+1] bool, ancestor-or-self (lower triangular)
    child_maps: tuple[dict[int, int], ...]  # n+1 maps, child token -> child node index
    # the same tokens and depths as Python ints (trees built here carry them: a batched step reads every tree's
    # without a tensor operation); None: read from the tensors
    host: HostTree | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        n = int(self.token_ids.shape[0])
        if self.token_ids.dim() != 1 or tuple(self.depths.shape) != (n,):
            raise ValueError("token_ids and depths must both have shape [n]")
        if tuple(self.parents.shape) != (n + 1,):
            raise ValueError(f"parents must have shape [{n + 1}], got {tuple(self.parents.shape)}")
        if tuple(self.visibility.shape) != (n + 1, n + 1):
            raise ValueError(f"visibility must have shape [{n + 1}, {n + 1}], got {tuple(self.visibility.shape)}")
        if len(self.child_maps) != n + 1:
            raise ValueError(f"child_maps must hold {n + 1} maps, got {len(self.child_maps)}")

    @property
    def num_nodes(self) -> int:
        """Number of drafted nodes ``n`` (the root excluded)."""
        return int(self.token_ids.shape[0])

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for a root-only tree)."""
        if self.host is not None:
            return max(self.host.depths, default=0)
        return int(self.depths.max().item()) if self.num_nodes else 0

    @property
    def host_tokens(self) -> tuple[int, ...]:
        """Node tokens (nodes 1..n) as Python ints."""
        return self.host.tokens if self.host is not None else tuple(self.token_ids.tolist())

    @property
    def host_depths(self) -> tuple[int, ...]:
        """Node depths (nodes 1..n) as Python ints."""
        return self.host.depths if self.host is not None else tuple(self.depths.tolist())


@dataclass(frozen=True)
class HostTree:
    """A tree's node tokens and depths (nodes 1..n) as Python ints."""

    tokens: tuple[int, ...]
    depths: tuple[int, ...]


def _assemble(tokens: list[int], depths: list[int], parents: list[int]) -> DraftTree:
    """Build a :class:`DraftTree` from per-node lists (``parents`` includes the root's -1)."""
    n = len(tokens)
    rows = [1]  # per node, its ancestors-or-self as the bits of a Python int: its parent's plus its own
    child_maps: list[dict[int, int]] = [{} for _ in range(n + 1)]
    for i in range(1, n + 1):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; a parent must precede its child")
        if depths[i - 1] != (depths[p - 1] if p > 0 else 0) + 1:
            raise ValueError(f"node {i} has depth {depths[i - 1]} but its parent {p} is not one level up")
        tok = tokens[i - 1]
        if tok in child_maps[p]:
            raise ValueError(f"node {p} has two children with token {tok}")
        child_maps[p][tok] = i
        rows.append(rows[p] | (1 << i))
    return DraftTree(  # through numpy: torch.tensor of a Python list costs several times more
        token_ids=torch.from_numpy(np.array(tokens, dtype=np.int64)),  # [n]
        depths=torch.from_numpy(np.array(depths, dtype=np.int64)),  # [n]
        parents=torch.from_numpy(np.array(parents, dtype=np.int64)),  # [n+1]
        visibility=torch.from_numpy(_bit_rows(rows, n + 1)),  # [n+1, n+1]
        child_maps=tuple(child_maps),
        host=HostTree(tuple(tokens), tuple(depths)),
    )


def _bit_rows(rows: list[int], width: int) -> np.ndarray:
    """Python ints whose bit j marks column j -> bool [len(rows), width]."""
    if width <= 64:
        bits = np.array(rows, dtype=np.uint64)[:, None] >> np.arange(width, dtype=np.uint64)  # [rows, width]
        return (bits & np.uint64(1)).astype(np.bool_)
    packed = b"".join(row.to_bytes((width + 7) // 8, "little") for row in rows)
    table = np.frombuffer(packed, dtype=np.uint8).reshape(len(rows), -1)
    return np.unpackbits(table, axis=1, count=width, bitorder="little").astype(np.bool_)


def tree_from_parents(token_ids: Sequence[int], parents: Sequence[int]) -> DraftTree:
    """Build a tree from node tokens (nodes 1..n) and parents (``[n+1]``, ``parents[0] == -1``).

    Depths are derived from the parents. Raises ``ValueError`` unless every parent precedes its child and siblings
    have distinct tokens.
    """
    tokens = [int(t) for t in token_ids]
    par = [int(p) for p in parents]
    if len(par) != len(tokens) + 1 or par[0] != -1:
        raise ValueError("parents must have len(token_ids) + 1 entries and start with -1 (the root)")
    depths: list[int] = []
    for i in range(1, len(par)):
        p = par[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; a parent must precede its child")
        depths.append(1 if p == 0 else depths[p - 1] + 1)
    return _assemble(tokens, depths, par)


def linear_chain_tree(draft_tokens: Sequence[int]) -> DraftTree:
    """The degenerate tree of linear DFlash: node ``i`` has token ``draft_tokens[i-1]``, depth ``i``, parent ``i-1``."""
    tokens = [int(t) for t in draft_tokens]
    n = len(tokens)
    return _assemble(tokens, list(range(1, n + 1)), [-1, *range(n)])


def topk_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-``k`` candidates: (log-probabilities, token ids), each ``[depth, k]``, sorted descending.

    The log-probabilities are float32 ``logit - logsumexp(row)`` over the whole vocabulary (a true log-softmax,
    not renormalised over the ``k``), computed on the logits' device without materialising ``[depth, vocab]``
    log-probabilities; on the reference's CPU kind this is bit-identical to the reference implementation (torch's
    float32 logsumexp can differ by a few ulps on CPUs of another vector width).
    """
    logits = draft_logits.detach().to(torch.float32)  # [depth, vocab]
    top_logits, top_ids = torch.topk(logits, k, dim=-1, largest=True, sorted=True)  # [depth, k] each
    top_lp = top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # [depth, k]
    return top_lp, top_ids


def build_tree(
    draft_logits: torch.Tensor, budget: int, *, seed_top1_chain: bool = False, token_ids: torch.Tensor | None = None
) -> DraftTree:
    """Grow the best-first draft tree of ``budget`` nodes (root excluded) from the drafter's logits.

    ``draft_logits`` is ``[depth, vocab]``: row ``d-1`` holds the logits of block position ``d``. Per depth the
    ``K = min(budget, vocab)`` best tokens are candidates, with float32 log-softmax log-probabilities over the
    whole vocabulary. A node is a choice of rank ``r_i < K`` at each depth ``i <= d``; its score is the sum of the
    chosen log-probabilities. Starting from (depth 1, rank 0) in a max-heap, each popped node joins the tree and
    offers its next sibling (same parent, rank + 1) and its first child (rank 0 one level deeper). Since a score
    never increases along a path, the result is exactly the ``budget`` highest-scoring prefixes, numbered in pop
    order (non-increasing score; ties broken by the rank tuples). Fewer than ``budget`` nodes are returned only if
    the candidate space runs out (tiny vocab and depth). ``budget == 0`` or ``depth == 0`` gives the root alone.

    ``seed_top1_chain=True`` first inserts the greedy chain (rank 0 at every depth ``1..min(depth, budget)``) as
    nodes ``1..``, so the linear DFlash path is always verified, then fills the remaining budget with the same
    best-first process, skipping the chain nodes it meets again (they are not counted twice but still offer their
    siblings and children). The result is the chain plus the best ``budget - len(chain)`` prefixes not on it; it is
    still prefix-closed, and every parent still precedes its children.

    ``token_ids`` ``[columns]`` names the token of each column of ``draft_logits`` when the drafter scores a
    shortlist (every other token's logit being -inf, the log-softmax over the columns is the one over the whole
    vocabulary); None: column ``c`` is token ``c``.
    """
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be [depth, vocab], got shape {tuple(draft_logits.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    depth, vocab = (int(s) for s in draft_logits.shape)
    if budget == 0 or depth == 0 or vocab == 0:
        return _assemble([], [], [-1])

    k = min(budget, vocab)
    # One top-k and one log-sum-exp on the logits' own device, then a single host transfer of [depth, K].
    top_lp_t, top_ids_t = topk_log_probs(draft_logits, k)  # [depth, K] each
    if token_ids is not None:
        top_ids_t = token_ids[top_ids_t]  # columns -> token ids
    return tree_from_candidates(top_lp_t.cpu().tolist(), top_ids_t.cpu().tolist(), budget,
                                seed_top1_chain=seed_top1_chain)


def tree_from_candidates(
    top_lp: list[list[float]], top_ids: list[list[int]], budget: int, *, seed_top1_chain: bool = False
) -> DraftTree:
    """`build_tree` from the per-depth candidates already on the host: `top_lp`, `top_ids` [depth][K] (sorted
    descending, as `topk_log_probs` gives them). Lets a caller take the top-k of many requests' logits at once."""
    depth = len(top_lp)
    k = len(top_lp[0]) if depth else 0
    if budget == 0 or depth == 0 or k == 0:
        return _assemble([], [], [-1])
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = [-1]
    scores: list[float] = [0.0]  # per node, root first

    chain_len = min(depth, budget) if seed_top1_chain else 0
    for d in range(1, chain_len + 1):
        tokens.append(top_ids[d - 1][0])
        depths.append(d)
        parents.append(d - 1)
        scores.append(scores[-1] + top_lp[d - 1][0])

    # Heap entry: (-score, rank tuple, parent node index). The rank tuple's length is the depth; it also breaks
    # ties deterministically (lexicographic, smaller ranks first).
    heap: list[tuple[float, tuple[int, ...], int]] = [(-top_lp[0][0], (0,), 0)]
    while heap and len(tokens) < budget:
        neg_score, ranks, parent = heapq.heappop(heap)
        d = len(ranks)
        r = ranks[-1]
        if d <= chain_len and r == 0 and parent == d - 1:
            node = d  # greedy-chain node already placed by the seed (all ranks 0, chain parent)
        else:
            node = len(tokens) + 1
            tokens.append(top_ids[d - 1][r])
            depths.append(d)
            parents.append(parent)
            scores.append(-neg_score)
        if r + 1 < k:  # next sibling: same parent, next rank at this depth
            sib_score = scores[parent] + top_lp[d - 1][r + 1]
            heapq.heappush(heap, (-sib_score, (*ranks[:-1], r + 1), parent))
        if d < depth:  # first child: best token one level deeper
            child_score = scores[node] + top_lp[d][0]
            heapq.heappush(heap, (-child_score, (*ranks, 0), node))

    return _assemble(tokens, depths, parents)


def _posterior_list(posterior: Sequence[int] | torch.Tensor, n_rows: int) -> list[int]:
    """The target's per-node choices as a flat Python list of ``n_rows`` ints (accepts ``[n+1]`` or ``[1, n+1]``)."""
    if isinstance(posterior, torch.Tensor):
        if posterior.dim() == 2 and posterior.shape[0] == 1:
            posterior = posterior[0]
        if posterior.dim() != 1:
            raise ValueError(f"posterior must be [n+1] or [1, n+1], got shape {tuple(posterior.shape)}")
        values = [int(v) for v in posterior.tolist()]  # one host transfer
    else:
        values = [int(v) for v in posterior]
    if len(values) != n_rows:
        raise ValueError(f"posterior must hold one choice per tree node ({n_rows}), got {len(values)}")
    return values


def follow_tree(tree: DraftTree, posterior: Sequence[int] | torch.Tensor) -> tuple[list[int], int]:
    """Walk a verified tree with the target's choices; return (visited node indices, bonus token).

    ``posterior[i]`` is the target's choice for the token following node ``i`` (``[n+1]`` or ``[1, n+1]``). From
    the root, while the choice at the current node is the token of one of its children, move to that child. The
    visited list starts with the root (so its length is the round's acceptance length, 1 = nothing accepted), and
    the bonus is the choice at the last visited node. Committed tokens: root, visited nodes' tokens, bonus.
    """
    choices = _posterior_list(posterior, tree.num_nodes + 1)
    visited = [0]
    node = 0
    while True:
        child = tree.child_maps[node].get(choices[node])
        if child is None:
            return visited, choices[node]
        visited.append(child)
        node = child


def accepted_tokens(tree: DraftTree, visited: Sequence[int]) -> list[int]:
    """Tokens of the visited drafted nodes (the root excluded), in path order."""
    ids = tree.host_tokens
    return [ids[i - 1] for i in visited if i > 0]


def tree_verify_inputs(
    tree: DraftTree,
    root_token: int,
    start: int,
    past_length: int,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack a tree into one target forward: (input ids, position ids, boolean visibility mask).

    * input ids ``[n+1]`` int64: the root token, then the node tokens in node order;
    * position ids ``[n+1]`` int64: ``start`` for the root, ``start + depth`` for each node;
    * mask ``[n+1, past_length + n+1]`` bool, True = may attend: every row sees all ``past_length`` committed
      positions, and inside the tree block row ``i`` sees ``visibility[i]`` (its ancestors and itself).
    """
    if past_length < 0:
        raise ValueError(f"past_length must be >= 0, got {past_length}")
    n1 = tree.num_nodes + 1
    start = int(start)
    input_ids = torch.from_numpy(np.array([int(root_token), *tree.host_tokens], dtype=np.int64)).to(device)  # [n+1]
    depths = np.array([0, *tree.host_depths], dtype=np.int64)  # [n+1]
    position_ids = torch.from_numpy(depths + start).to(device)  # [n+1]
    visibility = tree.visibility.to(device=device, dtype=torch.bool)
    if past_length == 0:  # [n+1, n+1]: the tree's own mask (a copy: the caller may write into it)
        mask = visibility.clone() if visibility is tree.visibility else visibility
        return input_ids, position_ids, mask
    mask = torch.ones(n1, past_length + n1, dtype=torch.bool, device=device)  # [n+1, past + n+1]
    mask[:, past_length:] = visibility
    return input_ids, position_ids, mask
