"""Linear-attention state in fixed buffers, for forwards replayed from CUDA graphs (`dflash.fastpath.runner`).

A graph bakes in its tensors' addresses, and replaying it must not change what it reads: so a forward reads the
committed windows and states and writes the state after its rows to a second set of buffers (`next_*`) and its
per-row inputs to fixed row buffers, never touching the committed ones. What happens next is decided on the host,
as with `RecurrentStates`:

* a crop or keep (a speculative round's accepted rows, a tree's path) replays the kept rows from the committed
  state into it, in place, for every layer at once (one program launch over layers x heads);
* anything else first commits the whole forward (one copy of the `next_*` buffers): the next forward, through
  `KVCache.reserve`, which every forward calls first, or a snapshot.

A graph padded past its live rows reads their count from a device tensor (`count_rows`, set while the graph is
built), so the state after a chain is that of its live rows. Every layer's buffers are slices of one tensor per kind,
which is what lets a commit or a replay cover all layers in a launch or two. Snapshots (the prefix cache's) are
copies. The torch forms serve where the program does not (the CPU tests of the runner's eager path).
"""

from __future__ import annotations

import torch

from dflash.errors import GenerationError
from dflash.kv.recurrent import (
    ROLLBACK_MAX_ROWS,
    DeltaRows,
    RecurrentShape,
    RecurrentSnapshot,
    RecurrentStates,
    replayed_state,
)


class StaticRecurrentStates(RecurrentStates):
    """`RecurrentStates`' contract over fixed buffers (see the module's text)."""

    def __init__(
        self,
        layers: int,
        shape: RecurrentShape,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_rows: int = ROLLBACK_MAX_ROWS,
    ) -> None:
        super().__init__(0, shape, batch=batch, dtype=dtype, device=device)  # no per-layer tensors of its own
        s, device = shape, self.device
        window = (layers, batch, s.conv_kernel - 1, s.conv_channels)
        state = (layers, batch, s.value_heads, s.key_dim, s.value_dim)
        self.committed_windows = torch.zeros(window, dtype=dtype, device=device)
        self.committed_states = torch.zeros(state, dtype=torch.float32, device=device)
        self.next_windows = torch.zeros_like(self.committed_windows)
        self.next_states = torch.zeros_like(self.committed_states)
        self.max_rows = max_rows
        heads = (layers, batch, s.value_heads, max_rows)
        # key heads as the layer computes them (q/k/v channels = 2 * key heads * key_dim + value heads * value_dim),
        # each serving value_heads / key_heads value heads: kept once, not repeated
        self.key_heads = (s.conv_channels - s.value_heads * s.value_dim) // (2 * s.key_dim)
        self.kept = DeltaRows(
            conv_inputs=torch.zeros((layers, batch, max_rows, s.conv_channels), dtype=dtype, device=device),
            k=torch.zeros((layers, batch, self.key_heads, max_rows, s.key_dim), dtype=torch.float32, device=device),
            v=torch.zeros((*heads, s.value_dim), dtype=torch.float32, device=device),
            g=torch.zeros(heads, dtype=torch.float32, device=device),
            beta=torch.zeros(heads, dtype=torch.float32, device=device),
        )
        self.layers = layers
        self._pending: str | None = None  # the last forward, not yet committed: "chain" or "tree"
        self._kept_rows = 0  # rows of the last forward in `kept` (-1: too many to keep)

    # ---- what a forward calls -------------------------------------------------------------------------------
    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        # never commits here: a graph's build reads too, and must capture reads only (`KVCache.reserve` commits)
        return self.committed_windows[slot], self.committed_states[slot]

    def final_buffer(self, slot: int) -> torch.Tensor | None:
        return self.next_states[slot]

    def row_buffers(self, slot: int, rows: int) -> DeltaRows | None:
        """Where a forward of `rows` rows may write what it feeds the layer's state, in place of `write`'s copies
        (None: too many rows to keep). Batch 0's: [rows, channels], k [key_heads, rows, key_dim], v [value_heads,
        rows, value_dim], g and beta [value_heads, rows] (strided views)."""
        if rows > self.max_rows:
            return None
        kept = self.kept
        return DeltaRows(
            kept.conv_inputs[slot, 0, :rows], kept.k[slot, 0, :, :rows], kept.v[slot, 0, :, :rows],
            kept.g[slot, 0, :, :rows], kept.beta[slot, 0, :, :rows],
        )

    def write(self, slot: int, window: torch.Tensor, state: torch.Tensor | None, rows: DeltaRows) -> None:
        """As `RecurrentStates.write`, copying into the fixed buffers (skipping what a forward wrote in place)."""
        if window.data_ptr() != self.next_windows[slot].data_ptr():
            self.next_windows[slot].copy_(window)
        if state is not None and state.data_ptr() != self.next_states[slot].data_ptr():
            self.next_states[slot].copy_(state)
        count = rows.k.shape[2]
        if count <= self.max_rows:
            for name in ("conv_inputs", "k", "v", "g", "beta"):
                kept, given = getattr(self.kept, name), getattr(rows, name)
                if given.data_ptr() == kept[slot].data_ptr():
                    continue  # written in place (`row_buffers`)
                if name == "conv_inputs":
                    kept[slot, :, :count].copy_(given)
                elif name == "k" and given.shape[1] != self.key_heads:  # repeated per value head: one per key head
                    kept[slot, :, :, :count].copy_(given[:, :: given.shape[1] // self.key_heads])
                else:
                    kept[slot, :, :, :count].copy_(given)
        self.note_forward(count, tree=self.tree_ancestors is not None)

    def note_forward(self, rows: int, *, tree: bool) -> None:
        """The host's record of a forward of `rows` live rows (a graph's replay does not run `write`)."""
        self._pending = "tree" if tree else "chain"
        self._kept_rows = rows if rows <= self.max_rows else -1

    # ---- commits and rollbacks ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Commit a chain forward whole (the next forward, a snapshot); a tree must have been cut to a path."""
        if self._pending == "tree":
            raise GenerationError("a tree verification's rows must be cut to one path before the next forward")
        if self._pending == "chain":
            self.committed_windows.copy_(self.next_windows)
            self.committed_states.copy_(self.next_states)
            self._pending = None

    def crop(self, length: int) -> None:
        if length == self.length and self._pending != "tree":
            self.settle()
            return
        if length == 0:
            self.reset()
            return
        if self._pending is None or not self._base_length <= length <= self.length:
            raise GenerationError(
                f"linear-attention state covers {self.length} positions and can roll back only into its last "
                f"forward ({self._base_length} .. {self.length}), not to {length}"
            )
        self._replay(list(range(length - self._base_length)))

    def keep(self, start: int, positions: list[int]) -> None:
        rows = [position - start for position in positions]
        count = self.length - self._base_length
        if (
            self._pending is None or start != self._base_length or any(not 0 <= row < count for row in rows)
            or rows != sorted(set(rows))
        ):
            raise GenerationError(
                f"cannot keep positions {positions} of the last forward ({count} rows from {self._base_length})"
            )
        self._replay(rows)

    def _replay(self, rows: list[int]) -> None:
        """Every layer's committed window and state advanced by the last forward's `rows`, in place."""
        if self._kept_rows < 0 or any(row >= self._kept_rows for row in rows):
            raise GenerationError(f"the last forward was too long to roll back ({self.length - self._base_length} rows)")
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            kernel = self.shape.conv_kernel
            picked_inputs = self.kept.conv_inputs.index_select(2, index)  # [layers, batch, n, channels]
            windows = torch.cat((self.committed_windows, picked_inputs), dim=2)[:, :, -(kernel - 1) :]
            self.committed_windows.copy_(windows)
            k, v, g, beta = (getattr(self.kept, name).index_select(3, index) for name in ("k", "v", "g", "beta"))
            flat = self.committed_states.view(-1, *self.committed_states.shape[2:])  # [layers * batch, heads, ...]
            picked = DeltaRows(picked_inputs, k.flatten(0, 1), v.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1))
            replayed_state(picked, flat, final=flat)
        self.length = self._base_length + len(rows)
        self._pending = None

    # ---- snapshots ------------------------------------------------------------------------------------------
    def snapshot(self) -> RecurrentSnapshot:
        self.settle()
        return RecurrentSnapshot(
            tuple(w.clone() for w in self.committed_windows), tuple(s.clone() for s in self.committed_states)
        )

    def restore(self, snapshot: RecurrentSnapshot, length: int) -> None:
        if len(snapshot.windows) != self.layers:
            raise ValueError(f"a snapshot of {len(snapshot.windows)} linear layers for {self.layers}")
        for slot in range(self.layers):
            self.committed_windows[slot].copy_(snapshot.windows[slot])
            self.committed_states[slot].copy_(snapshot.states[slot])
        self._pending = None
        self.length = self._base_length = length

    def reset(self) -> None:
        self.committed_windows.zero_()
        self.committed_states.zero_()
        self._pending = None
        self._kept_rows = 0
        self.checkpoints = {}
        self.length = self._base_length = 0
