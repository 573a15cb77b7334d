"""rich progress bars, summary tables and output redirection, shared by the stages and
the benchmarks."""

from __future__ import annotations

import contextlib
import os
import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

MIN_WIDTH = 100
"""Columns of the console where stderr is not a terminal (a pipe, CI, a SLURM log) and
``COLUMNS`` is unset: rich's 80 would wrap the tables."""


def wide_console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr) as wide as the terminal, or :data:`MIN_WIDTH`
    where it is not one and ``COLUMNS`` is unset."""
    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, width=MIN_WIDTH)
    return out


console = wide_console(stderr=True)
"""The console of the stages and ``packline run``: stderr (stdout stays for ``--json``)."""


LOG_EVERY_S = 30.0
"""Seconds between the plain progress lines written where stderr is not a terminal."""


class _Progress(Progress):
    """rich's Progress that, where stderr is not a terminal (a SLURM job's log, a pipe),
    writes a plain line per task at most every ``log_every`` seconds and when it finishes,
    e.g. ``pretraining: loss 0.459  757/900 (84%)  elapsed 0:37:12  remaining 0:07:03``: a
    log then shows how far a long job is, which the bar alone only does on a terminal."""

    def __init__(self, *columns, log_every: float, **kwargs):
        super().__init__(*columns, **kwargs)
        self._log_every = log_every
        self._last_line: dict[TaskID, float] = {}
        self._ended: set[TaskID] = set()

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._note(task_id)
        self._log(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._note(task_id)
        self._log(task_id)

    def _note(self, task_id) -> None:
        global _LAST
        task = self._tasks[task_id]
        if task.total:
            _LAST = (min(task.completed / task.total, 1.0), task.description)

    def _log(self, task_id) -> None:
        if self.disable or self.console.is_terminal:
            return
        task = self._tasks[task_id]
        now = time.monotonic()
        done = task.total is not None and task.completed >= task.total
        if done:
            if task_id in self._ended:
                return
            self._ended.add(task_id)
        elif now - self._last_line.get(task_id, -float("inf")) < self._log_every:
            return
        self._last_line[task_id] = now
        line = f"{task.description}  {task.completed:,.0f}"
        if task.total is not None:
            line += f"/{task.total:,.0f} ({task.percentage:.0f}%)"
        line += f"  elapsed {_clock(task.elapsed)}"
        if not done and task.time_remaining is not None:
            line += f"  remaining {_clock(task.time_remaining)}"
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


_LAST: tuple[float, str] | None = None


def last_fraction() -> tuple[float, str] | None:
    """How far this process's most recently advanced progress task with a known total got
    (fraction done, its description), None before any: what a stage that fails part way
    (a device that fills, :mod:`packline.faults`) reports of its progress."""
    return _LAST


def _clock(seconds: float | None) -> str:
    s = int(seconds or 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress(*, disable: bool = False, log_every: float = LOG_EVERY_S) -> Progress:
    """A progress display for long stage work: a bar on a terminal; elsewhere a plain line
    every ``log_every`` seconds and at the end of each task (:class:`_Progress`).
    ``disable`` shows nothing, e.g. on data-parallel ranks other than 0."""
    return _Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=disable,
        log_every=log_every,
    )


def summary_table(title: str, rows: dict[str, object]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for k, v in rows.items():
        table.add_row(k, _fmt(v))
    return table


_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
UNITS = ("FLOP", "FLOP/s", "B", "B/s")
"""Units written with the prefix joined to them (``47.8 GFLOP``); others take it on the number
(``12.3k tokens/s``)."""


def si(value: float, unit: str = "", digits: int = 3) -> str:
    """``value`` with an SI prefix and its unit.

    >>> si(4.7768e10, "FLOP"), si(12345, "tokens/s"), si(0.5, "s"), si(7.3e6, "B")
    ('47.8 GFLOP', '12.3k tokens/s', '0.5 s', '7.3 MB')
    """
    scale, prefix = next(((f, p) for f, p in _PREFIXES if abs(value) >= f), (1.0, ""))
    number = f"{value / scale:.{digits}g}"
    if unit in UNITS:
        return f"{number} {prefix}{unit}"
    return f"{number}{prefix} {unit}".rstrip()


def _fmt(v: object) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True):
    """Send everything written to file descriptor 1 (Python prints, Energon's ``prepare``
    messages, child processes) to stderr while active, so ``--json`` output stays one JSON
    object on stdout."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
