"""Progress of a benchmark run: a live bar on a terminal, one line per run in a log file."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextlib.contextmanager
def bench_progress(console: Console, total: int) -> Iterator[Callable[[int, int], None]]:
    """Yield ``on_progress(done, total)`` for :func:`specwise.lab.bench.run_benchmark`.

    On a terminal it drives a rich progress bar of ``total`` runs; otherwise (output to a file)
    it prints ``bench: done/total runs`` to stderr, so a log holds no control sequences.
    """
    if not console.is_terminal:
        yield lambda done, total: print(f"bench: {done}/{total} runs", file=sys.stderr, flush=True)
        return
    columns = (TextColumn("bench"), BarColumn(), TextColumn("{task.completed}/{task.total} runs"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("bench", total=total)
        yield lambda done, total: bar.update(task, completed=done)
