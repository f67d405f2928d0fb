"""Progress display for long work (loading, training, benchmarks): rich bars on a terminal, log lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class _LineProgress:
    """Fallback for logs and pipes: prints a line at most every `interval` seconds."""

    def __init__(self, label: str, total: int, interval: float = 10.0) -> None:
        self.label, self.total, self.done, self.interval = label, total, 0, interval
        self.started = self.last = time.monotonic()

    def advance(self, amount: int = 1, note: str = "") -> None:
        self.done += amount
        now = time.monotonic()
        if now - self.last >= self.interval or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            print(f"[{self.label}] {self.done}/{self.total} ({rate:.2f}/s) {note}".rstrip(), file=sys.stderr, flush=True)


class _RichProgress:
    def __init__(self, label: str, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[note]}"), transient=False,
        )
        self.task = self.progress.add_task(label, total=total, note="")

    def advance(self, amount: int = 1, note: str = "") -> None:
        self.progress.update(self.task, advance=amount, note=note)


@contextmanager
def progress_bar(label: str, total: int) -> Iterator[_LineProgress | _RichProgress]:
    if sys.stderr.isatty():
        bar = _RichProgress(label, total)
        with bar.progress:
            yield bar
    else:
        yield _LineProgress(label, total)
