"""The function NeMo-Run runs for each stage (in its own process).

It takes only plain, serialisable arguments: the path of the resolved pipeline config the
CLI wrote, the stage name, and the MLflow parent run id. A user error (bad input or
config) is written to ``<work>/<stage>.error.json`` so the CLI can report it with exit 2, a
crash on the user's input (:class:`~schemas.errors.InputCrash`) likewise, with exit 1.
A SLURM job may start it as several tasks (connect, ``connect.num_tasks``): each runs its
share; the one that merges logs the stage, the others end with exit 0 and log nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from schemas.config import load_config
from schemas.errors import InputCrash, UserError

ERROR_SUFFIX = ".error.json"


def error_path(work_dir: Path, stage: str) -> Path:
    return Path(work_dir) / f"{stage}{ERROR_SUFFIX}"


def run_stage_task(config_path: str, stage: str, parent_run_id: str = "") -> None:
    """Entry point of one NeMo-Run task: run ``stage`` of the config at ``config_path``."""
    from stages.runner import run_stage

    cfg = load_config(config_path)
    err = error_path(cfg.work_path, stage)
    if int(os.environ.get("SLURM_NTASKS", "1")) == 1:
        # alone in its job: clear an old report (of several tasks, one could clear another's
        # report; the pipeline clears them before it submits)
        err.unlink(missing_ok=True)
    try:
        run_stage(cfg, stage, parent_run_id=parent_run_id or None)
    except UserError as exc:
        _report(err, {"header": exc.header, "problems": exc.problems, "exit_code": 2})
        print(str(exc), file=sys.stderr)
        sys.exit(2)
    except InputCrash as exc:
        crash = {"where": exc.where, "error": exc.error, "log": exc.log}
        _report(err, {"header": str(exc), "problems": [], "exit_code": 1, "crash": crash})
        print(str(exc), file=sys.stderr)
        sys.exit(1)


def _report(err: Path, report: dict) -> None:
    """Write the task's error for the pipeline (on a device too full for even that, the
    error stays on the task's stderr, in its log)."""
    tmp = err.with_name(f".{err.name}.{os.getpid()}.tmp")  # tasks may fail at once
    try:
        tmp.write_text(json.dumps(report))
        os.replace(tmp, err)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"cannot write {err}: {exc}", file=sys.stderr)


def reported_error(work_dir: Path, stage: str) -> UserError | InputCrash | None:
    """The error a task of ``stage`` reported (what the CLI exits with), or None."""
    err = error_path(work_dir, stage)
    if not err.is_file():
        return None
    info = json.loads(err.read_text())
    if "crash" in info:
        return InputCrash(**info["crash"])
    return UserError(info["problems"], info["header"])
