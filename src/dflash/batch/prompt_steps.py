"""Prompt steps of the batched core: which prompt chunks a step prefills, their rows, the prefix cache's blocks
restored at admission and stored as a prompt ends, and each prompt's end: its drafter context written early, its
first token chosen (read back in the step, or after the next launch where a chain of device rounds runs)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dflash.batch.core_parts import CoreParts
from dflash.batch.draft_pass import DraftRows, absorb_context_rows
from dflash.batch.rounds import FirstToken
from dflash.batch.sequence import Sequence
from dflash.batch.target_pass import TargetRows
from dflash.generation.cached_prefill import prefix_cache_usable
from dflash.kv.prefix_cache import PrefixCache, restorable

log = logging.getLogger("dflash.batch")


class PromptSteps:
    _first_tokens: list[FirstToken] | None  # the prompts ended in this step, their first token not read yet

    def _prefill_work(self: CoreParts) -> list[tuple[Sequence, int, int]]:
        """Chunks to prefill this step: up to one chunk of tokens, oldest sequences first, each chunk on its
        prompt's chunk grid (so the prefix cache's blocks stay exact)."""
        chunk = max(1, self.settings.prefill_chunk)
        budget = chunk * self.settings.prefill_chunks_per_step
        work: list[tuple[Sequence, int, int]] = []
        for seq in self.active:
            if seq.phase != "prefill":
                continue
            lo = seq.prefilled
            hi = min(seq.prompt_length, (lo // chunk + 1) * chunk)
            if work and hi - lo > budget:
                break
            work.append((seq, lo, hi))
            budget -= hi - lo
            if budget <= 0:
                break
        return work

    def _prefill_rows(self: CoreParts, seq: Sequence, lo: int, hi: int) -> TargetRows:
        # the padded passes load their rows from the host (`_target_pass` moves them where they run packed)
        device = torch.device("cpu") if self.graphs is not None else self.target_pool.device
        assert seq.target is not None
        last = slice(hi - lo - 1, hi - lo) if hi == seq.prompt_length else slice(0, 0)
        return TargetRows(
            seq.target, torch.tensor(seq.request.prompt_ids[lo:hi], dtype=torch.long, device=device),
            torch.arange(lo, hi, device=device), logit_rows=last,
        )

    def _keeps_features(self: CoreParts, seq: Sequence) -> bool:
        return bool(self.capture) and (seq.speculative or self._cache_for(seq) is not None)

    def _cache_for(self: CoreParts, seq: Sequence) -> PrefixCache | None:
        cache = self.prefix_cache if seq.request.use_prefix_cache else None
        capture = self.capture if seq.speculative else ()
        return cache if prefix_cache_usable(cache, self.settings.prefill_chunk, capture) else None

    def _restore_prefix(self: CoreParts, seq: Sequence) -> None:
        cache = self._cache_for(seq)
        if cache is None:
            return
        assert seq.target is not None
        recurrent = seq.target.recurrent
        blocks = restorable(cache.lookup(seq.request.prompt_ids, limit=seq.prompt_length - 1), recurrent is not None)
        if recurrent is not None:  # keep the state at every block boundary of the prefill, for `_store_prefix`
            recurrent.checkpoint_every = cache.block_tokens
        start = 0
        for block in blocks:
            end = start + len(block.tokens)
            slots = seq.target.slots(start, end)
            self.target_pool.keys[:, :, slots] = block.keys.to(self.target_pool.keys.dtype)
            self.target_pool.values[:, :, slots] = block.values.to(self.target_pool.values.dtype)
            if self._keeps_features(seq) and block.features is not None:
                seq.prompt_features.append(block.features)
            start = end
        last = blocks[-1].recurrent if blocks else None
        if recurrent is not None and last is not None:
            recurrent.restore(last, start)
        seq.target.crop(start)
        seq.prefilled = start
        seq.stats.cached_tokens = min(start, seq.stats.prompt_tokens)

    def _after_prefill(self: CoreParts, seq: Sequence, lo: int, hi: int, logits: torch.Tensor, features: torch.Tensor | None
    ) -> None:
        assert seq.target is not None
        seq.target.crop(hi)
        seq.prefilled = hi
        if features is not None and self._keeps_features(seq):
            seq.prompt_features.append(features)
        if hi < seq.prompt_length:
            return
        self._store_prefix(seq)
        if seq.target.recurrent is not None:  # decoding rows may be rolled back: no snapshots of them
            seq.target.recurrent.checkpoint_every = 0
            seq.target.recurrent.checkpoints = {}
        seq.new_features = torch.cat(seq.prompt_features) if seq.speculative and seq.prompt_features else None
        seq.prompt_features = []
        self._absorb_prompt(seq)  # queued before the first token's read below waits for the GPU
        chosen = seq.chooser.choose(logits, 0)[:1]  # [1]
        if self._first_tokens is None:
            self._start_decoding(seq, int(chosen[0]))
            return
        # read after the step's next launch (`_read_first`)
        host = torch.empty(1, dtype=chosen.dtype, pin_memory=chosen.is_cuda)
        host.copy_(chosen, non_blocking=True)
        event = None
        if chosen.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._first_tokens.append(FirstToken(seq, host, event))

    def _start_decoding(self: CoreParts, seq: Sequence, first: int) -> None:
        # the prompt's time ends with its first token on the host: on a GPU, queuing the passes takes a fraction of it
        seq.decode_started = time.perf_counter()
        seq.stats.prefill_s = seq.decode_started - seq.prefill_started
        seq.chooser.observe([first])
        seq.start, seq.pending = seq.prompt_length, first
        seq.phase = "decode"
        if seq.sink.push(first):
            self._end(seq)

    @contextmanager
    def _prompts_beside_launch(self: CoreParts) -> Iterator[list[tuple[Sequence, int, int]]]:
        """Around a step that launches ahead (a device round or a plain step): the prompt chunks due run first in a
        pass of their own, their first tokens copied back without a wait, and are read once the step's work is
        queued (so the host does not wait for the launched step to run). Yields the chunks."""
        prefills = self._prefill_work()
        self._first_tokens = []
        try:
            if prefills:
                self._step_prefilled = True
                self._prefill_alone(prefills)
            yield prefills
        finally:
            self._read_first()

    def _read_first(self: CoreParts) -> None:
        """The prompts' first tokens copied back by `_after_prefill` this step: each request starts decoding."""
        firsts, self._first_tokens = self._first_tokens or [], None
        for first in firsts:
            if first.event is not None:
                first.event.synchronize()
            self._guarded(first.seq, self._start_decoding, first.seq, int(first.host[0]))

    def _absorb_prompt(self: CoreParts, seq: Sequence) -> None:
        """The prompt's drafter context but its last block into the drafter pool, as its prefill ends: launched
        while the GPU still runs the step's passes, not when the request's first round loads (which waits for the
        GPU to finish the round before it first). The last block stays: a round's drafter block reads it fresh."""
        features = seq.new_features
        if features is None or seq.drafter is None or self.drafter is None or self.drafter_pool is None:
            return
        excess = features.shape[0] - self.drafter.config.block_size
        if excess <= 0:
            return
        rows = [DraftRows(seq.drafter, features[:excess], 0, 0, 0)]
        if self.drafter_graphs is not None:
            self.drafter_graphs.context.absorb(rows)
        else:
            absorb_context_rows(self.drafter, self.drafter_pool, rows)
        seq.new_features = features[excess:]

    def _store_prefix(self: CoreParts, seq: Sequence) -> None:
        """Keep the full blocks of the prompt positions prefilled so far (whole prompt, or a cancelled part)."""
        cache = self._cache_for(seq)
        assert seq.target is not None
        length = seq.prefilled
        if cache is None or length < cache.block_tokens:
            return
        slots = seq.target.slots(0, length)
        keys = self.target_pool.keys[:, :, slots]  # [layers, kv_heads, length, head_dim]
        values = self.target_pool.values[:, :, slots]
        features = torch.cat(seq.prompt_features)[None] if cache.feature_layers and seq.prompt_features else None
        recurrent = seq.target.recurrent.checkpoints if seq.target.recurrent is not None else None
        cache.store_rows(seq.request.prompt_ids, keys, values, features, recurrent=recurrent)

    def _prefill_alone(self: CoreParts, prefills: list[tuple[Sequence, int, int]]) -> None:
        """Prompt chunks in a pass of their own (the decoding requests' round is on the device)."""
        try:
            rows = [self._prefill_rows(seq, lo, hi) for seq, lo, hi in prefills]
            out = self._target_pass(rows, len(prefills), False)
        except Exception as exc:  # the chunks' computation failed: their sequences end with the error
            log.exception("batched step failed")
            for seq, _, _ in prefills:
                self._end(seq, exc)
            return
        features = out.features
        for index, (seq, lo, hi) in enumerate(prefills):
            self._guarded(seq, self._after_prefill, seq, lo, hi, out.logits[index],
                          features[index] if features is not None else None)
