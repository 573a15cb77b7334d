"""What ``packline run`` reports at its end: a table of the stages (state, seconds, headline
figure) and, when a stage failed, its reason first, then the error the CLI exits with."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import sys
import threading
from pathlib import Path

from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from packline.backends import backend
from packline.catalog import read_forecast
from packline.progress import console
from packline.report.forecast import forecast_table
from packline.report.summary import COMPARISON, RunSummary
from packline.report.table import summary_table as run_table
from pipelines.tasks import reported_error
from schemas.config import STAGES, PipelineConfig
from schemas.errors import UserError
from stages.base import read_record, stage_dir
from stages.runner import available_stages, headline

UP_TO_DATE = "UP TO DATE"
"""The state of a stage whose completion record matched: not launched (shown as SKIPPED)."""


def pipeline_stages() -> list[str]:
    """The stages this build of packline has, in pipeline order."""
    have = set(available_stages())
    return [s for s in STAGES if s in have]


def raise_on_failure(cfg: PipelineConfig, states: dict[str, str], *, logs: Path) -> None:
    """Nothing when every stage succeeded or was up to date; else print the summary, the
    failing stage's reason first, and raise it: UserError (exit 2) when the stage reported
    bad input or config, RuntimeError otherwise."""
    failed = next(
        (s for s in pipeline_stages() if states.get(s) not in ("SUCCEEDED", UP_TO_DATE)), None
    )
    if failed is None:
        done = [f"{s} {states[s]}" for s in pipeline_stages() if s in states]
        console.print("[green]pipeline finished:[/] " + ", ".join(done))
        return
    reported = reported_error(cfg.work_path, failed)
    if isinstance(reported, UserError):
        reason = reported.header
    elif reported is not None:
        reason = str(reported)
    else:
        reason = f"{states.get(failed, 'did not run').lower()} (logs under {logs})"
    console.print(f"[bold red]{failed} failed:[/] {reason}")
    console.print(summary_table(cfg, states, failed=(failed, reason)))
    if reported is not None:
        raise reported
    raise RuntimeError(f"stage {failed} did not succeed ({states}); logs under {logs}")


def stage_log(cfg: PipelineConfig, stage: str) -> Path:
    """``<work>/logs/<stage>/output.log``: everything a local stage task printed (its
    progress, library messages, its tables), kept from its NeMo-Run job dir; SLURM jobs'
    logs are copied beside it (:func:`pipelines.slurm_jobs.gather_logs`)."""
    return cfg.work_path / "logs" / stage / "output.log"


def keep_stage_log(cfg: PipelineConfig, exp_dir: Path, stage: str) -> Path | None:
    """Copy the local task's combined output, from its NeMo-Run experiment dir, into
    :func:`stage_log`; None when it left none."""
    found = sorted(exp_dir.glob(f"{stage}/**/combined.log"))
    if not found:
        return None
    dest = stage_log(cfg, stage)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(found[-1], dest)
    return dest


def last_line(text: str) -> str:
    """What a live log shows last: the text after its last line end or carriage return (a
    progress bar redraws itself with ``\\r``), else the last non-empty line.

    >>> last_line("prepare\\ntrain packed loss 2.1  3/40\\rtrain packed loss 2.0  4/40\\r\\n")
    'train packed loss 2.0  4/40'
    """
    pieces = [p.strip() for p in re.split(r"[\r\n]", text)]
    return next((p for p in reversed(pieces) if p), "")


@contextlib.contextmanager
def running(stage: str, exp_dir: Path):
    """While ``stage`` runs, on a terminal only: a spinner, the elapsed time and the last
    line of the stage's live log (its progress) in ``exp_dir``, NeMo-Run's experiment dir."""
    if not console.is_terminal:
        yield
        return
    done = threading.Event()
    columns = (SpinnerColumn(), TextColumn(f"[bold]{stage}[/]"), TimeElapsedColumn())
    columns += (TextColumn("{task.description}"),)
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting")

        def follow() -> None:
            while not done.wait(0.5):
                log = next(iter(sorted(exp_dir.glob(f"{stage}/**/combined.log"))), None)
                if log is not None:
                    with log.open("rb") as f:
                        f.seek(max(0, log.stat().st_size - 4096))
                        line = last_line(f.read().decode(errors="replace"))
                    bar.update(task, description=escape(line[: max(20, console.width - 30)]))

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()


def report_stage(cfg: PipelineConfig, stage: str, state: str, *, tables: bool = True) -> None:
    """What the console shows when a launched stage ends: one line (state, seconds), then
    validate's warnings, and with ``tables`` the one table a user reads there: the packing
    forecast after connect, packing on vs off after train."""
    rec = read_record(cfg.work_path, stage) or {}
    if state != "SUCCEEDED":
        console.print(f"[red]✗[/] {stage:<9} {state.lower()}")
        return
    console.print(f"[green]✓[/] {stage:<9} {rec.get('seconds', 0):6.1f} s")
    for warning in rec.get("summary", {}).get("warnings", []):
        console.print(f"  [yellow]warning:[/] {warning}")
    if not tables:
        return
    if stage == "connect" and (forecast := read_forecast(cfg)):
        console.print(forecast_table(forecast, cfg.packing.packing_buffer_size))
    comparison = stage_dir(cfg, "train") / COMPARISON
    if stage == "train" and comparison.is_file():
        runs = [RunSummary.from_dict(r) for r in json.loads(comparison.read_text())["runs"]]
        console.print(run_table(runs, source=f"from {comparison}"))


def _shown(path: Path | str) -> str:
    """``path`` relative to the working directory when inside it (``runs/tiny_cpu/...``),
    else absolute; links are kept (a venv's ``bin/python`` is one)."""
    path = Path(os.path.abspath(path))
    here = Path(os.path.abspath(Path.cwd()))
    return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)


def invoked_as() -> list[str]:
    """How this packline was started, for commands that work as printed: ``packline`` when
    it is the one on PATH, else its path (``.venv/bin/packline`` after ``make run``), or
    ``python -m pipelines.cli``."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "packline":
        on_path = shutil.which("packline")
        if on_path and Path(on_path).resolve() == argv0.resolve():
            return ["packline"]
        return [_shown(argv0)]
    return [_shown(sys.executable), "-m", "pipelines.cli"]


def next_steps(cfg: PipelineConfig, prog: list[str], args: list[str]) -> list[tuple[str, str]]:
    """What to do after a finished run, as (what, command or path). The commands name the
    config as the run was given it (``args``: a config file at most), else this run's
    resolved ``pipeline.yaml``, which holds the overrides too."""
    from packline.catalog import adapter_dir

    given = args if len(args) <= 1 and not any("=" in a for a in args) else None
    config = given if given is not None else [_shown(cfg.work_path / "pipeline.yaml")]

    def command(name: str, *options: str) -> str:
        return shlex.join([*prog, name, *config, *options])

    local = backend(cfg).trains_here  # a PEFT adapter dir, which chat loads
    steps = [("logs", _shown(cfg.work_path / "logs") + "/")]
    if local:
        steps.append(("adapter", _shown(adapter_dir(cfg)) + "/  (model card: README.md)"))
    steps += [("MLflow UI", command("ui")), ("compare", command("compare"))]
    if local:
        steps.append(("chat", command("chat")))  # replays a validation question
    steps.append(("export", command("export", "--merge")))  # a merged HF checkpoint
    return steps


def print_next_steps(cfg: PipelineConfig, args: list[str]) -> None:
    """The run's last block: :func:`next_steps`, one per line, never wrapped (copy a
    command whole)."""
    console.print("[bold]next steps[/]")
    for what, text in next_steps(cfg, invoked_as(), args):
        console.print(f"  {what:<10} {text}", soft_wrap=True, highlight=False)


def summary_table(
    cfg: PipelineConfig, states: dict[str, str], failed: tuple[str, str] | None = None
) -> Table:
    """Stage, state, time and headline figure of the pipeline just run; with ``failed``
    (the stage, its reason) the stages after it are shown as SKIPPED, not started."""
    table = Table(title=f"packline run · {cfg.name} · {cfg.work_path}", title_justify="left")
    for col in ("stage", "state", "seconds", "result"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    order = pipeline_stages()
    for stage in order:
        rec = read_record(cfg.work_path, stage) or {}
        state = states.get(stage, "-")
        result = headline(cfg, stage, rec.get("metrics", {}))
        if failed is not None and stage == failed[0]:
            result = failed[1]
        elif failed is not None and order.index(stage) > order.index(failed[0]):
            state, result = "SKIPPED", f"not started: {failed[0]} failed"
        elif state == UP_TO_DATE:
            state, result = "SKIPPED", f"up to date; {result}"
        seconds = "-" if state in ("SKIPPED", "FAILED") else f"{rec.get('seconds', 0):.1f}"
        table.add_row(stage, state, seconds, result)
    return table
