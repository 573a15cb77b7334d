"""rich progress bars, summary tables and output redirection, shared by the stages and
the benchmarks."""

from __future__ import annotations

import contextlib
import os
import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

console = Console(stderr=True)


def progress(*, disable: bool = False) -> Progress:
    """A progress display for long stage work (a no-op refresh when not on a terminal;
    ``disable`` shows nothing, e.g. on data-parallel ranks other than 0)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=disable,
    )


def summary_table(title: str, rows: dict[str, object]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for k, v in rows.items():
        table.add_row(k, _fmt(v))
    return table


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
