"""The pipeline as a NeMo-Run experiment: one ``run.Partial`` per stage, each depending on
the one before it. Stage skipping lives in the stages (completion records), not here."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import nemo_run as run
from omegaconf import OmegaConf

from packline.backends import backend
from packline.faults import quiet_thread_faults
from packline.fingerprints import stage_fingerprint
from packline.progress import console
from packline.rules.megatron import megatron_problems
from packline.tracking import Tracker
from packline.workdir import hold
from pipelines.executors import make_executor, slurm_problems
from pipelines.outcome import (
    UP_TO_DATE,
    keep_stage_log,
    pipeline_stages,
    raise_on_failure,
    report_stage,
    running,
    summary_table,
)
from pipelines.slurm_jobs import SlurmJob, gather_logs, jobs_table, sacct, submitted_jobs
from pipelines.tasks import error_path, run_stage_task
from schemas.config import ExecutorKind, PipelineConfig
from schemas.errors import UserError
from stages.base import invalidate_from, is_up_to_date, read_record
from stages.runner import run_stage


@dataclass
class PipelineOutcome:
    experiment_id: str
    parent_run_id: str | None
    states: dict[str, str]


def write_resolved_config(cfg: PipelineConfig) -> Path:
    """The config every stage process loads: the CLI's fully resolved tree."""
    cfg.work_path.mkdir(parents=True, exist_ok=True)
    path = cfg.work_path / "pipeline.yaml"
    d = cfg.to_dict()
    # Absolute paths: stage processes may start in another working directory.
    d["work_dir"] = str(cfg.work_path)
    if d["data"]["source"] != "synthetic":
        d["data"]["source"] = str(Path(d["data"]["source"]).expanduser().resolve())
    for section in ("processor", "model"):
        if d[section]["path"]:
            d[section]["path"] = str(Path(d[section]["path"]).expanduser().resolve())
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(d)))
    return path


def nemorun_dir(cfg: PipelineConfig) -> Path:
    """NeMo-Run's base dir for this pipeline. Not ``nemo_run``: without a container NeMo-Run
    rewrites every ``/nemo_run`` in a generated sbatch script to the job's dir."""
    return cfg.work_path / "nemorun"


def new_experiment_id(cfg: PipelineConfig) -> str:
    """A fresh experiment id, in NeMo-Run's own ``<title>_<time_ns>`` form."""
    return f"packline-{cfg.name}_{time.time_ns()}"


def experiment_dir(cfg: PipelineConfig, exp_id: str) -> Path:
    """Where NeMo-Run keeps experiment ``exp_id``'s jobs (its ``<base>/experiments/<title>``)."""
    return nemorun_dir(cfg) / "experiments" / f"packline-{cfg.name}" / exp_id


def new_experiment(
    cfg: PipelineConfig, exp_id: str | None = None, *, verbose: bool = True
) -> run.Experiment:
    """A NeMo-Run experiment under ``<work>/nemorun``, named ``exp_id`` (a fresh one by
    default): the id is ours, so nothing reads it back from NeMo-Run's private state.

    ``verbose`` False silences NeMo-Run's own console (banners, the task status block);
    its closing hint (``nemo experiment status <id>``) is never shown: it fails as printed,
    needing ``NEMORUN_HOME`` set to ``<work>/nemorun``."""
    return run.Experiment(
        f"packline-{cfg.name}",
        id=exp_id or new_experiment_id(cfg),
        base_dir=str(nemorun_dir(cfg)),
        log_level="WARN",
        clean_mode=not verbose,
        enable_goodbye_message=False,
        skip_status_at_exit=not verbose,
    )


def add_stages(
    exp: run.Experiment,
    cfg: PipelineConfig,
    config_path: Path,
    parent_run_id: str | None,
    stages: list[str],
) -> list[str]:
    """One ``run.Partial`` per stage, each depending on the one before (inside ``with exp``)."""
    job_dir = nemorun_dir(cfg) / "experiments"  # LocalTunnel's job_dir must be this
    ids: list[str] = []
    for stage in stages:
        task = run.Partial(
            run_stage_task,
            config_path=str(config_path),
            stage=stage,
            parent_run_id=parent_run_id or "",
        )
        ids.append(
            exp.add(
                task,
                executor=make_executor(cfg, job_dir=job_dir, stage=stage),
                name=stage,
                dependencies=ids[-1:] or None,
            )
        )
    return ids


def dryrun_text(cfg: PipelineConfig, config_path: Path) -> str:
    """What ``packline run --executor slurm --dryrun`` prints: every stage's sbatch script in
    submission order, and with ``train.backend: megatron`` the Bridge recipe and overrides the
    train job applies inside the container. Nothing is submitted."""
    stages = pipeline_stages()
    with new_experiment(cfg) as exp:
        add_stages(exp, cfg, config_path, None, stages)
        # NeMo-Run's SLURM dryrun writes each job's script, the file it would submit, to
        # <experiment_dir>/<job_name>_sbatch.sh; read them, then remove the experiment dir.
        exp.dryrun(log=False, delete_exp_dir=False)
        executors = {job.id: job.executor for job in exp.jobs}
        try:
            scripts = {
                id_: (Path(ex.experiment_dir) / f"{ex.job_name}_sbatch.sh").read_text()
                for id_, ex in executors.items()
            }
        finally:
            for exp_dir in {ex.experiment_dir for ex in executors.values()}:
                shutil.rmtree(exp_dir, ignore_errors=True)
    out = [
        f"# packline run --dryrun · {cfg.name} · executor slurm · {len(stages)} job(s), each "
        "submitted with sbatch --dependency=afterok:<the previous job>",
    ]
    for i, stage in enumerate(stages, 1):
        out += [
            "",
            f"## job {i}/{len(stages)}: {stage}",
            f"# runs pipelines.tasks.run_stage_task(config_path={str(config_path)!r}, "
            f"stage={stage!r}) in the job's code/ dir",
            scripts[stage].rstrip(),
        ]
    if "train" in stages and (plan := backend(cfg).plan(cfg)):
        out += ["", *plan]
    return "\n".join(out) + "\n"


def stages_to_launch(cfg: PipelineConfig) -> list[str]:
    """The first stage whose completion record does not match its inputs, and every stage
    after it; the stages before it are up to date and are not launched at all."""
    stages = pipeline_stages()
    for i, stage in enumerate(stages):
        if not is_up_to_date(cfg.work_path, stage, stage_fingerprint(cfg, stage)):
            return stages[i:]
    return []


def run_pipeline(
    cfg: PipelineConfig,
    *,
    from_stage: str | None = None,
    dryrun: bool = False,
    verbose: bool = False,
) -> PipelineOutcome:
    """Run the stages in order as NeMo-Run tasks, holding the work dir's lock; raise
    UserError (exit 2) when a stage reported bad input, RuntimeError when one failed
    otherwise. A failed stage stops the chain: the stages after it never start.

    Up-to-date stages are skipped here, in this process, from their completion records
    (logged to MLflow as skipped children); the rest run as dependent NeMo-Run tasks. A
    stage's own output goes to its log (:func:`pipelines.outcome.stage_log`), and to the
    console too with ``verbose``; the console shows a line per stage, the forecast and the
    training comparison once each, and the summary.
    """
    # The rules validate runs too (SLURM, Megatron), checked here before anything is
    # submitted; the data and model rules run in the validate stage itself.
    problems = slurm_problems(cfg) + megatron_problems(cfg)
    if problems:
        raise UserError(problems, f"cannot run this config with executor {cfg.executor.kind.value}")
    with hold(cfg.work_path):
        return _run_pipeline(cfg, from_stage=from_stage, dryrun=dryrun, verbose=verbose)


def _run_pipeline(
    cfg: PipelineConfig, *, from_stage: str | None, dryrun: bool, verbose: bool
) -> PipelineOutcome:
    config_path = write_resolved_config(cfg)
    if dryrun:
        if cfg.executor.kind == ExecutorKind.slurm:
            print(dryrun_text(cfg, config_path), end="")
        else:
            with new_experiment(cfg) as exp:
                add_stages(exp, cfg, config_path, None, pipeline_stages())
                exp.dryrun(delete_exp_dir=True)
        return PipelineOutcome("dryrun", None, {})
    slurm = cfg.executor.kind == ExecutorKind.slurm
    if slurm and not cfg.executor.slurm.host and not shutil.which("sbatch"):
        hint = (
            "--executor slurm submits from this machine, which has no sbatch: run on a login "
            "node, set executor.slurm.host, or start scripts/slurm-local.sh and export SLURM_CONF"
        )
        raise UserError([hint], "no SLURM here")
    if from_stage:
        invalidate_from(cfg.work_path, from_stage)
    launch = stages_to_launch(cfg)
    for stage in launch:
        error_path(cfg.work_path, stage).unlink(missing_ok=True)
    parent = Tracker.start(
        cfg, f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}", tags={"packline.kind": "pipeline"}
    )
    states: dict[str, str] = {}
    exp_ids: list[str] = []
    status = "FAILED"
    # NeMo-Run's log copy (a thread) fails too when the work dir fills: one line, no traceback
    with quiet_thread_faults():
        try:
            for stage in pipeline_stages():
                if stage not in launch:
                    run_stage(cfg, stage, parent_run_id=parent.run_id)  # skips: record matches
                    states[stage] = UP_TO_DATE
            if slurm and launch:
                # One job per stage, each after the one before (afterok): SLURM cancels the jobs
                # after a failed one (kill_on_invalid_dep), so none of them starts.
                exp_ids.append(new_experiment_id(cfg))
                with new_experiment(cfg, exp_ids[-1], verbose=verbose) as exp:
                    add_stages(exp, cfg, config_path, parent.run_id, launch)
                    exp.run(sequential=False, detach=False, tail_logs=False)
                states.update(task_states(exp))
                report_slurm_jobs(cfg, exp)
                for stage in launch:
                    report_stage(cfg, stage, states.get(stage, "UNKNOWN"))
            else:
                # NeMo-Run's local executor starts a dependent task whatever its dependency's
                # outcome: one experiment per stage, and the chain ends at the first failure.
                for stage in launch:
                    exp_ids.append(new_experiment_id(cfg))
                    with (
                        running(stage, experiment_dir(cfg, exp_ids[-1])),
                        new_experiment(cfg, exp_ids[-1], verbose=verbose) as exp,
                    ):
                        add_stages(exp, cfg, config_path, parent.run_id, [stage])
                        exp.run(detach=False, tail_logs=verbose)
                    states.update(task_states(exp))
                    keep_stage_log(cfg, experiment_dir(cfg, exp_ids[-1]), stage)
                    report_stage(cfg, stage, states[stage], tables=not verbose)
                    if states[stage] != "SUCCEEDED":
                        break
            raise_on_failure(cfg, states, logs=cfg.work_path / "logs")
            console.print(summary_table(cfg, states))
            for stage in pipeline_stages():
                rec = read_record(cfg.work_path, stage) or {}
                parent.log_metrics(rec.get("metrics", {}))
            status = "FINISHED"
        finally:
            parent.end(status)
    return PipelineOutcome(",".join(exp_ids), parent.run_id, states)


def task_states(exp: run.Experiment) -> dict[str, str]:
    """Each task's final state as NeMo-Run reports it (``SUCCEEDED``, ``FAILED``, ...)."""
    return {
        name: str(info.get("status", "UNKNOWN")).split(".")[-1]
        for name, info in exp.status(return_dict=True).items()
    }


def report_slurm_jobs(cfg: PipelineConfig, exp: run.Experiment) -> list[SlurmJob]:
    """Show each stage's job as sacct has it and copy its logs into ``<work>/logs/``."""
    jobs = submitted_jobs(exp)
    if jobs:
        sacct(exp.jobs[0].executor.tunnel, jobs)
        gather_logs(cfg, exp, jobs)
        console.print(jobs_table(jobs))
    return jobs
