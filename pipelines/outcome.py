"""What ``packline run`` reports at its end: a table of the stages (state, seconds, headline
figure) and, when a stage failed, its reason first, then the error the CLI exits with."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from packline.progress import console
from pipelines.tasks import reported_error
from schemas.config import STAGES, PipelineConfig
from schemas.errors import UserError
from stages.base import read_record
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
        console.log("[green]pipeline finished:[/] " + ", ".join(done))
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
        rec = read_record(cfg, stage) or {}
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
