"""Per-sequence state of linear-attention (Gated DeltaNet) layers, kept beside the K/V cache and rolled back with it.

A linear layer's past is not a list of slots but two tensors: the last `kernel - 1` inputs of its causal
convolution (the window) and the delta rule's state matrix per value head. `KVCache` owns one `RecurrentStates`
when the model has such layers, so every loop that passes a cache carries them without new arguments.

Speculative decoding runs a block of draft rows and then crops the cache to the accepted length. K/V slots past
that length are simply ignored, but a recurrent state has already absorbed every row. So each write keeps the
state from before the forward (`base`) and, for short forwards, what each row fed the state (`DeltaRows`); a crop
inside the last forward replays the kept rows from `base` with the token-by-token rule, which gives the state after
exactly those rows, the convolution window included. A long forward (a prefill chunk) keeps no rows, and cropping
into it is an error, as is cropping before the last forward: the loops never do either.

No tensor here is ever written in place (each forward, crop or reset makes new ones), so holding the current
tensors is a snapshot (`RecurrentSnapshot`): during a prefill the states at every prefix-cache block boundary are
kept that way (`checkpoint_every`), and a cached prefix restores the state at its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.errors import GenerationError
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
    k: torch.Tensor  # [batch, value_heads, rows, key_dim], normalised and repeated per value head
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

    def write(self, slot: int, window: torch.Tensor, state: torch.Tensor, rows: DeltaRows) -> None:
        """The layer's window and state after this forward's rows (the previous ones become the rollback base).
        The window and the kept convolution inputs are copied: as views they would keep the whole forward's
        projections (a prefill chunk, or every request of a packed batch) alive."""
        self._base_windows[slot], self._base_states[slot] = self.windows[slot], self.states[slot]
        self.windows[slot], self.states[slot] = window.clone(), state
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

    def crop(self, length: int) -> None:
        """Keep the states after the first `length` positions: a prefix of the last forward, or nothing at all."""
        if length == self.length:
            return
        if length == 0:
            self.reset()
            return
        if not self._base_length <= length < self.length:
            raise GenerationError(
                f"linear-attention state covers {self.length} positions and can roll back only to "
                f"{self._base_length} .. {self.length}, not {length}"
            )
        keep = length - self._base_length
        kernel = self.shape.conv_kernel
        for slot, rows in enumerate(self._rows):
            if rows is None:
                raise GenerationError(f"the last forward was too long to roll back ({self.length - self._base_length} rows)")
            window = torch.cat((self._base_windows[slot], rows.conv_inputs[:, :keep]), dim=1)[:, -(kernel - 1) :]
            part = slice(0, keep)
            state = delta_rule_state(
                rows.k[:, :, part], rows.v[:, :, part], rows.g[:, :, part], rows.beta[:, :, part],
                self._base_states[slot],
            )
            self.windows[slot], self.states[slot] = window, state
            self._rows[slot] = DeltaRows(
                rows.conv_inputs[:, :keep], rows.k[:, :, part], rows.v[:, :, part], rows.g[:, :, part],
                rows.beta[:, :, part],
            )
        self.length = length

    def reset(self) -> None:
        """Back to an empty sequence."""
        count = len(self.windows)
        self.windows = [self._empty_window() for _ in range(count)]
        self.states = [self._empty_state() for _ in range(count)]
        self._base_windows, self._base_states = list(self.windows), list(self.states)
        self._rows = [None] * count
        self.checkpoints = {}
        self.length = self._base_length = 0
