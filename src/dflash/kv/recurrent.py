"""Per-sequence state of linear-attention (Gated DeltaNet) layers, kept beside the K/V cache and rolled back with it.

A linear layer's past is not a list of slots but two tensors: the last `kernel - 1` inputs of its causal
convolution (the window) and the delta rule's state matrix per value head. `KVCache` owns one `RecurrentStates`
when the model has such layers, so every loop that passes a cache carries them without new arguments.

Speculative decoding runs a block of draft rows and then crops the cache to the accepted length. K/V slots past
that length are simply ignored, but a recurrent state has already absorbed every row. A tree verification (DDTree)
runs its rows each along its own path (`tree_ancestors`, set for that forward) and keeps nothing of them: the
accepted path is replayed afterwards (`keep`, what `KVCache.compact` calls). So each write keeps the
state from before the forward (`base`) and, for short forwards, what each row fed the state (`DeltaRows`); a crop
inside the last forward replays the kept rows from `base` with the token-by-token rule, which gives the state after
exactly those rows, the convolution window included (on CUDA by the same Triton program the forward used, so the
state is bitwise the one a forward of those rows alone reaches). A long forward (a prefill chunk) keeps no rows,
and cropping into it is an error, as is cropping before the last forward: the loops never do either.

No tensor here is ever written in place (each forward, crop or reset makes new ones), so holding the current
tensors is a snapshot (`RecurrentSnapshot`): during a prefill the states at every prefix-cache block boundary are
kept that way (`checkpoint_every`), and a cached prefix restores the state at its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.errors import GenerationError
from dflash.kernels.triton_delta_rule import delta_rule_program_serves, delta_rule_rows
from dflash.models.delta_rule import delta_rule_state

# Forwards of at most this many rows keep their per-row inputs so that a crop can replay a prefix of them
# (verification blocks are one pending token plus at most block_size - 1 drafts).
ROLLBACK_MAX_ROWS = 64


@dataclass(frozen=True)
class RecurrentShape:
    """Sizes of one linear layer's state."""

    conv_channels: int  # q, k and v projections together
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int


@dataclass
class DeltaRows:
    """What one forward fed a linear layer's state, row by row (heads-first float32 as in `dflash.models.delta_rule`).
    The queries are not needed: replaying rebuilds the state, not the outputs."""

    conv_inputs: torch.Tensor  # [batch, rows, conv_channels], before the convolution
    k: torch.Tensor  # [batch, value_heads or key_heads, rows, key_dim], normalised (key heads: each serving several)
    v: torch.Tensor  # [batch, value_heads, rows, value_dim]
    g: torch.Tensor  # [batch, value_heads, rows]
    beta: torch.Tensor  # [batch, value_heads, rows]


@dataclass(frozen=True)
class RecurrentSnapshot:
    """Every linear layer's window and state after some number of positions."""

    windows: tuple[torch.Tensor, ...]  # each [batch, kernel - 1, conv_channels]
    states: tuple[torch.Tensor, ...]  # each [batch, heads, key_dim, value_dim]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.windows, *self.states))


class RecurrentStates:
    """Window and state of every linear layer of one (batch of) sequence(s), indexed by the layer's linear slot."""

    def __init__(
        self,
        layers: int,
        shape: RecurrentShape,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = shape
        self.batch, self.dtype, self.device = batch, dtype, torch.device(device)
        self.windows = [self._empty_window() for _ in range(layers)]  # each [batch, kernel - 1, conv_channels]
        self.states = [self._empty_state() for _ in range(layers)]  # each [batch, heads, key_dim, value_dim] fp32
        self._base_windows = list(self.windows)
        self._base_states = list(self.states)
        self._rows: list[DeltaRows | None] = [None] * layers
        self.length = 0  # positions the states have absorbed
        self._base_length = 0  # positions before the last forward
        self.checkpoint_every = 0  # when > 0, `advance` keeps a snapshot at every multiple of it in `checkpoints`
        self.checkpoints: dict[int, RecurrentSnapshot] = {}
        # during a tree verification's forward: which new rows each new row sees, [rows, rows] bool (itself and its
        # ancestors; a row's parent is its nearest ancestor)
        self.tree_ancestors: torch.Tensor | None = None
        self.count_rows: torch.Tensor | None = None  # a padded graph's live rows ([1] on the device), else None
        self._tree_pending = False  # the last forward was a tree: its rows must be cropped to a path or kept

    def _empty_window(self) -> torch.Tensor:
        s = self.shape
        return torch.zeros(self.batch, s.conv_kernel - 1, s.conv_channels, dtype=self.dtype, device=self.device)

    def _empty_state(self) -> torch.Tensor:
        s = self.shape
        size = (self.batch, s.value_heads, s.key_dim, s.value_dim)
        return torch.zeros(size, dtype=torch.float32, device=self.device)

    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(convolution window [batch, kernel - 1, channels], state [batch, heads, key_dim, value_dim])."""
        return self.windows[slot], self.states[slot]

    def settle(self) -> None:
        """Called before every forward (`KVCache.reserve`): nothing to do where each forward makes new tensors
        (`dflash.kv.static_recurrent` commits its last forward here)."""

    def final_buffer(self, slot: int) -> torch.Tensor | None:
        """Where a forward's program writes the layer's new state (None: a new tensor)."""
        return None

    def write(self, slot: int, window: torch.Tensor, state: torch.Tensor | None, rows: DeltaRows) -> None:
        """The layer's window and state after this forward's rows (the previous ones become the rollback base; a
        tree's forward passes None and keeps the state). The window and the kept convolution inputs are copied: as
        views they would keep the whole forward's projections (a prefill chunk, or every request of a packed batch)
        alive."""
        self._base_windows[slot], self._base_states[slot] = self.windows[slot], self.states[slot]
        self.windows[slot] = window.clone()
        if state is not None:
            self.states[slot] = state
        self._tree_pending = self.tree_ancestors is not None
        keep = rows.k.shape[2] <= ROLLBACK_MAX_ROWS
        self._rows[slot] = DeltaRows(rows.conv_inputs.clone(), rows.k, rows.v, rows.g, rows.beta) if keep else None

    def advance(self, new_tokens: int) -> None:
        """The forward that wrote every layer covered `new_tokens` positions."""
        self._base_length = self.length
        self.length += new_tokens
        if self.checkpoint_every and self.length % self.checkpoint_every == 0:
            self.checkpoints[self.length] = self.snapshot()

    def snapshot(self) -> RecurrentSnapshot:
        """The current windows and states (shared, not copied: they are never modified)."""
        return RecurrentSnapshot(tuple(self.windows), tuple(self.states))

    def restore(self, snapshot: RecurrentSnapshot, length: int) -> None:
        """Continue from `snapshot`, the state after `length` positions (a cached prefix); no rollback before it."""
        if len(snapshot.windows) != len(self.windows):
            raise ValueError(f"a snapshot of {len(snapshot.windows)} linear layers for {len(self.windows)}")
        self.windows, self.states = list(snapshot.windows), list(snapshot.states)
        self._base_windows, self._base_states = list(self.windows), list(self.states)
        self._rows = [None] * len(self.windows)
        self.length = self._base_length = length
        self._tree_pending = False

    def crop(self, length: int) -> None:
        """Keep the states after the first `length` positions: a prefix of the last forward, or nothing at all
        (after a tree forward, that prefix must be a path of the tree: its first rows, each the next's parent)."""
        if length == self.length and not self._tree_pending:
            return
        if length == 0:
            self.reset()
            return
        if not self._base_length <= length <= self.length:
            raise GenerationError(
                f"linear-attention state covers {self.length} positions and can roll back only to "
                f"{self._base_length} .. {self.length}, not {length}"
            )
        self._replay(list(range(length - self._base_length)))

    def keep(self, start: int, positions: list[int]) -> None:
        """Keep the states after the rows at `positions` (ascending, of the last forward, which began at `start`:
        a root-to-leaf path of a tree verification), as if the forward had taken those rows alone."""
        rows = [position - start for position in positions]
        count = self.length - self._base_length
        if start != self._base_length or any(not 0 <= row < count for row in rows) or rows != sorted(set(rows)):
            raise GenerationError(
                f"cannot keep positions {positions} of the last forward ({count} rows from {self._base_length})"
            )
        self._replay(rows)

    def _replay(self, rows: list[int]) -> None:
        """The states after the last forward's `rows` alone, replayed from the states before it."""
        kernel = self.shape.conv_kernel
        index = torch.tensor(rows, dtype=torch.long)
        for slot, kept in enumerate(self._rows):
            if kept is None:
                raise GenerationError(f"the last forward was too long to roll back ({self.length - self._base_length} rows)")
            picked = DeltaRows(
                kept.conv_inputs[:, index.to(kept.conv_inputs.device)], *(
                    t[:, :, index.to(t.device)] for t in (kept.k, kept.v, kept.g, kept.beta)
                ),
            )
            window = torch.cat((self._base_windows[slot], picked.conv_inputs), dim=1)[:, -(kernel - 1) :]
            state = replayed_state(picked, self._base_states[slot])
            self.windows[slot], self.states[slot], self._rows[slot] = window, state, picked
        self.length = self._base_length + len(rows)
        self._tree_pending = False

    def reset(self) -> None:
        """Back to an empty sequence."""
        count = len(self.windows)
        self.windows = [self._empty_window() for _ in range(count)]
        self.states = [self._empty_state() for _ in range(count)]
        self._base_windows, self._base_states = list(self.windows), list(self.states)
        self._rows = [None] * count
        self.checkpoints = {}
        self.length = self._base_length = 0
        self._tree_pending = False


def replayed_state(rows: DeltaRows, state: torch.Tensor, final: torch.Tensor | None = None) -> torch.Tensor:
    """The state after `rows` from `state`, by the program the forwards use where it serves (into `final` when
    given, which may be `state`), else by the torch rule. rows.k may hold key heads (fewer than rows.v's value
    heads, each serving as many consecutive value heads)."""
    if rows.k.shape[2] <= ROLLBACK_MAX_ROWS and delta_rule_program_serves(rows.k):
        _, after = delta_rule_rows(None, rows.k, rows.v, rows.g, rows.beta, state, final=final)
        assert after is not None
        return after
    keys = rows.k
    if keys.shape[1] != rows.v.shape[1]:  # key heads each serving several value heads: repeated for the torch rule
        keys = keys.repeat_interleave(rows.v.shape[1] // keys.shape[1], dim=1)
    after = delta_rule_state(keys, rows.v, rows.g, rows.beta, state)
    if final is not None:
        final.copy_(after)
        return final
    return after


def tree_parents(ancestors: torch.Tensor) -> list[int]:
    """Each row's parent in a verification tree from its ancestor mask [rows, rows] (a row sees itself and its
    ancestors, all earlier rows): the nearest ancestor, -1 for a root (a child of the committed prefix)."""
    mask = ancestors.to("cpu", torch.bool)
    parents = []
    for row in range(mask.shape[0]):
        earlier = torch.nonzero(mask[row, :row]).flatten()
        parents.append(int(earlier[-1]) if earlier.numel() else -1)
    return parents
