"""After a SLURM run: each stage's job id, its accounting record (sacct) and its logs.

NeMo-Run waits for the jobs and reports a state per task; this adds what a user asks next —
which job ran when, for how long, and where its output is. Logs are copied from each job's
NeMo-Run dir into ``<work>/logs/<stage>/`` (through the tunnel, so this works over SSH too).
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import nemo_run as run
from rich.table import Table

from schemas.config import PipelineConfig

#: sacct states after which a job's record no longer changes.
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
SACCT_FIELDS = ("JobID", "JobName", "State", "Elapsed", "Start", "End")


@dataclass
class SlurmJob:
    """One stage's batch job as SLURM accounting has it."""

    stage: str
    job_id: str
    name: str = ""
    state: str = "UNKNOWN"
    elapsed: str = ""
    start: str = ""
    end: str = ""
    log_dir: Path | None = None


def job_id(job) -> str:
    """SLURM job id of a launched NeMo-Run job (its handle ends with it)."""
    return str(job.handle).rstrip("/").rsplit("/", 1)[-1] if job.handle else ""


def submitted_jobs(exp: run.Experiment) -> list[SlurmJob]:
    return [SlurmJob(stage=job.id, job_id=job_id(job)) for job in exp.jobs if job_id(job)]


def sacct_command(job_ids: list[str]) -> str:
    """The shell command (a tunnel runs text) that reads the jobs' accounting records; every
    word quoted.

    >>> sacct_command(["17", "18"])
    'sacct --parsable2 --noheader -X -j 17,18 -o JobID,JobName,State,Elapsed,Start,End'
    """
    args = ["sacct", "--parsable2", "--noheader", "-X", "-j", ",".join(job_ids)]
    return shlex.join([*args, "-o", ",".join(SACCT_FIELDS)])


def listing_command(remote_dir: str) -> str:
    """The shell command that lists a job's dir, the path quoted.

    >>> listing_command("/w/my runs;x")
    "ls -1 -- '/w/my runs;x'"
    """
    return shlex.join(["ls", "-1", "--", remote_dir])


def sacct(tunnel, jobs: list[SlurmJob], *, wait_s: float = 30.0) -> list[SlurmJob]:
    """Fill each job's accounting fields; poll until every job is terminal (sacct lags a job's
    end by seconds) or ``wait_s`` passes."""
    if not jobs:
        return jobs
    cmd = sacct_command([j.job_id for j in jobs])
    deadline = time.monotonic() + wait_s
    while True:
        result = tunnel.run(cmd, hide=True, warn=True)
        rows = {}
        for line in (result.stdout or "").splitlines():
            parts = line.split("|")
            if len(parts) == len(SACCT_FIELDS):
                rows[parts[0]] = parts
        for j in jobs:
            if j.job_id in rows:
                _, j.name, state, j.elapsed, j.start, j.end = rows[j.job_id]
                j.state = state.split()[0]  # "CANCELLED by 0" → CANCELLED
        if all(j.state in TERMINAL for j in jobs) or time.monotonic() > deadline:
            return jobs
        time.sleep(1.0)


def gather_logs(cfg: PipelineConfig, exp: run.Experiment, jobs: list[SlurmJob]) -> None:
    """Copy each job's ``sbatch_*.out`` and ``log-*.out`` into ``<work>/logs/<stage>/``."""
    by_stage = {job.id: job for job in exp.jobs}
    for j in jobs:
        job = by_stage[j.stage]
        tunnel = job.executor.tunnel
        # The job's dir where the jobs run: the tunnel's experiment dir + the task's name.
        remote = f"{tunnel.job_dir}/{Path(job.executor.job_dir).name}"
        listing = tunnel.run(listing_command(remote), hide=True, warn=True).stdout or ""
        dest = cfg.work_path / "logs" / j.stage
        dest.mkdir(parents=True, exist_ok=True)
        for name in listing.split():
            if name.endswith(".out") and name.startswith(("sbatch_", "log-")):
                tunnel.get(f"{remote}/{name}", str(dest / name))
        j.log_dir = dest


def jobs_table(jobs: list[SlurmJob]) -> Table:
    table = Table(title="SLURM jobs (sacct), in submission order", title_justify="left")
    for col in ("stage", "job", "state", "elapsed", "start", "end", "logs"):
        table.add_column(col)
    for j in jobs:
        table.add_row(j.stage, j.job_id, j.state, j.elapsed, j.start, j.end, str(j.log_dir or ""))
    return table
