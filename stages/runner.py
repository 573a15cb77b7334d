"""Run one stage: skip it when its completion record matches, else build it, record it and
log it to MLflow as a child of the pipeline's parent run."""

from __future__ import annotations

import contextlib
import importlib
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from packline import metrics as names
from packline.backends import backend
from packline.faults import machine_fault
from packline.fingerprints import stage_fingerprint
from packline.hub import fetch_missing
from packline.progress import console, summary_table
from packline.tracking import Tracker
from packline.train.distributed import launched
from packline.workdir import hold
from packline.workers import forks_exit_with_me
from schemas.config import PipelineConfig
from schemas.errors import InputCrash, UserError
from stages import connect, prepare, validate
from stages.base import StageResult, is_up_to_date, read_record, result_from_record


def train_stage(
    cfg: PipelineConfig, fp: str | None = None, *, parent_run_id: str | None = None
) -> StageResult:
    """Stage train on ``train.backend``: the stage page its spec names
    (:attr:`packline.backends.Backend.train_stage`: packline's own trainer,
    :mod:`stages.train`, or the Megatron-Bridge finetune on the cluster,
    :mod:`stages.train_megatron`)."""
    module, _, name = backend(cfg).train_stage.partition(":")
    run = getattr(importlib.import_module(module), name)
    return run(cfg, fp, parent_run_id=parent_run_id)


#: stage name → the stage function (its record's key: packline.fingerprints.stage_fingerprint)
REGISTRY: dict[str, Callable[..., StageResult]] = {
    "prepare": prepare.prepare,
    "connect": connect.connect,
    "validate": validate.validate,
    "train": train_stage,
}
#: stages whose own MLflow runs nest under the stage's run
NESTS_RUNS = {"train"}
#: stages that may run as several tasks at once (connect, :mod:`packline.energon.parts`): one
#: MLflow run is logged, after the stage, by the task that merges (or a FAILED one by a task
#: that fails); a task that only measured its share logs nothing, and of several tasks that
#: find the stage up to date only task 0 logs the skip
SPREADS = {"connect"}


def available_stages() -> list[str]:
    return list(REGISTRY)


def _task_rank(cfg: PipelineConfig, name: str) -> int:
    """This process's task of a stage in :data:`SPREADS` (0 when it runs alone)."""
    task = connect.this_task(cfg) if name in SPREADS else None
    return task.rank if task is not None else 0


def run_stage(
    cfg: PipelineConfig, name: str, *, force: bool = False, parent_run_id: str | None = None
) -> StageResult:
    """Run stage ``name`` (or skip it when up to date) and log it to MLflow."""
    if name not in REGISTRY:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(REGISTRY)}")
    forks_exit_with_me()  # a killed stage leaves no loader worker behind
    with hold(cfg.work_path):  # one writer per work dir (re-entrant; a task of a run shares it)
        try:
            return _run_stage(cfg, name, force=force, parent_run_id=parent_run_id)
        except (UserError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            fault = machine_fault(exc, cfg.work_path, stage=name)
            if fault is not None:  # a full disk, a read-only mount...: a reason, not a bug
                raise fault from exc
            if name not in READS_USER_FILES:
                raise
            raise _crash(cfg, name, exc) from exc


#: stage → the stage that checks the settings it runs with (its record must be of them)
CHECKED_BY = {"train": "validate"}


def _renew(cfg: PipelineConfig, checker: str) -> None:
    """Renew ``checker``'s record when it is of other settings (``packline stage train
    key=value`` after a run): its errors stop the stage that needs it. Ranks of an outside
    launch (torchrun on SLURM) cannot check in parallel: there the stage refuses a stale
    record, and the pipeline's own job of ``checker`` renews it."""
    record = read_record(cfg.work_path, checker)
    if record is None or launched():
        return  # the stage refuses it, with the fix
    if record.get("fingerprint") != stage_fingerprint(cfg, checker):
        console.log(f"[yellow]{checker}: its record is for other settings; checking these[/]")
        REGISTRY[checker](cfg)


#: stages that read the user's files: an unexpected error there is reported as a crash on
#: that input (:class:`~schemas.errors.InputCrash`), its traceback in the stage's log
READS_USER_FILES = {"prepare", "connect"}


def crash_log(cfg: PipelineConfig, stage: str) -> Path:
    """Where a crash of ``stage`` writes its traceback."""
    return cfg.work_path / "logs" / f"{stage}.log"


def _crash(cfg: PipelineConfig, stage: str, exc: Exception) -> InputCrash:
    """``exc`` as one line naming the input (the file and sample the library named, else the
    source), its traceback appended to :func:`crash_log`."""
    log = crash_log(cfg, stage)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S%z')} packline {stage}\n")
        f.write("".join(traceback.format_exception(exc)))
    if isinstance(exc, InputCrash):
        return InputCrash(exc.where, exc.error, str(log))
    where = f"data.source {cfg.data.source}"
    if isinstance(exc, OSError) and exc.filename:
        where = str(exc.filename)
    return InputCrash(where, f"{type(exc).__name__}: {exc}", str(log))


#: stages that read Hub repos first: the dataset ``data.download`` lets packline fetch
#: (prepare), the model and processor ``model.download`` lets it fetch (connect), each before
#: the stage's fingerprint (which hashes their files)
FETCHES = {"prepare", "connect"}


def _run_stage(
    cfg: PipelineConfig, name: str, *, force: bool, parent_run_id: str | None
) -> StageResult:
    stage_fn = REGISTRY[name]
    if name in FETCHES:
        for repo in fetch_missing(cfg, name):
            console.log(f"fetched {repo} into the local Hugging Face cache")
    fp = stage_fingerprint(cfg, name)
    tags = {"packline.stage": name, "packline.skipped": "false"}
    if not force and is_up_to_date(cfg.work_path, name, fp):
        result = result_from_record(cfg.work_path, name)
        console.print(f"[green]✓[/] {name}: up to date (completion record matches), skipped")
        if _task_rank(cfg, name) == 0:
            tracker = Tracker.start(
                cfg, name, parent_run_id=parent_run_id, tags={**tags, "packline.skipped": "true"}
            )
            tracker.log_metrics(result.metrics)
            tracker.end()
        return result
    if name in CHECKED_BY:
        _renew(cfg, CHECKED_BY[name])
    if name in SPREADS:
        try:
            result = stage_fn(cfg, fp)
        except BaseException:
            with contextlib.suppress(Exception):  # the stage's own error goes on
                Tracker.start(cfg, name, parent_run_id=parent_run_id, tags=tags).end_failed()
            raise
        if result.partial:
            return result
        tracker = Tracker.start(cfg, name, parent_run_id=parent_run_id, tags=tags)
    else:
        tracker = Tracker.start(cfg, name, parent_run_id=parent_run_id, tags=tags)
        try:
            if name in NESTS_RUNS:
                result = stage_fn(cfg, fp, parent_run_id=tracker.run_id)
            else:
                result = stage_fn(cfg, fp)
        except BaseException:
            tracker.end_failed()
            raise
    tracker.log_metrics({**result.metrics, f"{name}/seconds": result.seconds})
    for artifact in result.summary.get("artifacts", []):
        tracker.log_artifact(Path(artifact))
    tracker.end()
    shown = {
        k.split("/", 1)[1]: v
        for k, v in result.metrics.items()
        if not (v == 0 and "/rejected_" in k)  # list only the reasons that occurred
    }
    console.print(summary_table(f"{name} ({result.seconds:.1f} s) → {result.out_dir}", shown))
    return result


def headline(cfg: PipelineConfig, stage: str, m: dict[str, float]) -> str:
    """The one figure of ``stage``'s record ``m`` (its metrics) a user looks for first."""
    if stage == "prepare":
        return (
            f"{m.get('prepare/rows_accepted', 0):,.0f} samples "
            f"({m.get('prepare/train_samples', 0):,.0f} train), "
            f"{m.get('prepare/rows_rejected', 0):,.0f} rejected"
        )
    if stage == "connect":
        b = cfg.packing.packing_buffer_size
        fill = m.get(f"connect/forecast_fill_b{b}")
        fill_text = f"; forecast fill {fill:.3f} (buffer {b})" if fill is not None else ""
        return (
            f"{m.get('connect/tokens_total', 0):,.0f} tokens, "
            f"{m.get('connect/overlength', 0):,.0f} too long{fill_text}"
        )
    if stage == "validate":
        fill = m.get("validate/forecast_fill")
        fill_text = f"; fill {fill:.3f}" if fill is not None else ""
        return (
            f"{m.get('validate/rules', 0):.0f} rules: {m.get('validate/errors', 0):.0f} errors, "
            f"{m.get('validate/warnings', 0):.0f} warnings{fill_text}"
        )
    if stage == "train":
        speedup = m.get(names.COMPARE_SPEEDUP_REAL_TOKENS_PER_S)
        per_cpu = m.get(names.COMPARE_SPEEDUP_PER_CPU_S)
        on = m.get(names.compare("packed", "real_tokens_per_s"))
        off = m.get(names.compare("unpacked", "real_tokens_per_s"))
        if speedup is not None and on is not None and off is not None:
            cpu = f" ({per_cpu:.2f}x per CPU-s)" if per_cpu is not None else ""
            return f"packed {on:,.0f} vs unpacked {off:,.0f} tok/s: {speedup:.2f}x{cpu}"
    return ""
