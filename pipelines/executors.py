"""NeMo-Run executor factories from the config: small functions with defaults.

Local: each stage is a subprocess of this machine, in this venv. SLURM: each stage is a batch
job; ``prepare``/``validate`` ask for one task and no GPU, ``connect`` for
``connect.num_tasks`` tasks over ``connect.nodes`` nodes and no GPU, srun starting each
(:func:`stage_tasks`; prepare with a CPU per worker process, each connect task with a CPU
per loader worker: :func:`stage_cpus`), ``train`` asks for ``nodes`` × ``gpus_per_node`` and
starts ``nproc_per_node`` processes per node with torchrun.
Jobs are submitted from this machine (LocalTunnel) or over SSH (``executor.slurm.host``); the
project's packages are shipped into each job's ``code/`` dir, which is the job's working
directory, so a job runs the code that was submitted, not whatever is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nemo_run as run

from schemas.config import PROJECT_ROOT, ExecutorKind, PipelineConfig
from schemas.errors import UserError
from schemas.rules import SLURM_RULES, train_nproc_per_node

#: What a job needs of the project (the rest of the tree stays home).
SHIPPED = ("packline", "stages", "schemas", "pipelines", "configs", "pyproject.toml")


def _venv_path() -> str:
    """PATH with this interpreter's bin first: NeMo-Run starts tasks with plain ``python``."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def local_executor(cfg: PipelineConfig) -> run.LocalExecutor:
    """Run each stage as a local subprocess of this machine, in this venv."""
    return run.LocalExecutor(env_vars={"PATH": _venv_path(), "PYTHONUNBUFFERED": "1"})


def project_packager(root: Path = PROJECT_ROOT) -> run.PatternPackager:
    """Ship packline's packages and configs into each job's ``code/`` dir."""
    return run.PatternPackager(
        include_pattern=[str(root / name) for name in SHIPPED],
        relative_path=[str(root)] * len(SHIPPED),
    )


def slurm_problems(cfg: PipelineConfig) -> list[str]:
    """What stops this config from running on SLURM (empty when it can): the errors of the
    SLURM rules (``schemas/rules.py``), which the validate stage lists too."""
    findings, _ = SLURM_RULES.run(cfg)
    return [f"{f.message}: {f.fix}" for f in findings if f.severity == "error"]


def slurm_tunnel(cfg: PipelineConfig, *, job_dir: Path) -> run.LocalTunnel | run.SSHTunnel:
    """LocalTunnel (sbatch on this machine), or SSHTunnel when ``slurm.host`` is set.
    ``job_dir`` must be ``<Experiment base_dir>/experiments``."""
    s = cfg.executor.slurm
    if s.host:
        return run.SSHTunnel(
            host=s.host,
            user=s.user or os.environ.get("USER", ""),
            job_dir=s.job_dir or str(job_dir),
        )
    return run.LocalTunnel(job_dir=str(job_dir))


def stage_cpus(cfg: PipelineConfig, stage: str) -> int | None:
    """CPUs a SLURM task of ``stage`` asks for (``--cpus-per-task``): prepare's worker
    processes, or each connect task's loader workers; None (SLURM's default) for the rest.
    Without it a cluster that confines tasks to their CPUs runs every worker on one core.

    >>> from schemas.config import load_config
    >>> cfg = load_config(None, ["prepare.num_workers=8", "connect.num_workers=0"])
    >>> stage_cpus(cfg, "prepare"), stage_cpus(cfg, "connect"), stage_cpus(cfg, "validate")
    (8, 1, None)
    """
    if stage == "prepare":
        return cfg.prepare.num_workers
    if stage == "connect":
        return max(cfg.connect.num_workers, 1)
    return None


def stage_tasks(cfg: PipelineConfig, stage: str) -> tuple[int, int]:
    """Nodes and tasks per node of ``stage``'s SLURM job: ``train``, the cluster's nodes ×
    its processes per node (torchrun starts them); ``connect``, ``connect.nodes`` ×
    ``connect.num_tasks / connect.nodes`` (srun starts each task, which measures its share);
    one task on one node for the rest.

    >>> from schemas.config import load_config
    >>> cfg = load_config(None, ["connect.num_tasks=8", "connect.nodes=2"])
    >>> stage_tasks(cfg, "connect"), stage_tasks(cfg, "prepare")
    ((2, 4), (1, 1))
    """
    if stage == "train":
        return cfg.executor.slurm.nodes, train_nproc_per_node(cfg)
    if stage == "connect":
        c = cfg.connect
        return c.nodes, c.num_tasks // c.nodes
    return 1, 1


def slurm_executor(cfg: PipelineConfig, *, job_dir: Path, stage: str) -> run.SlurmExecutor:
    """One SLURM batch job for ``stage``; ``train`` gets the GPUs and a torchrun launcher,
    ``connect`` its tasks (:func:`stage_tasks`)."""
    s = cfg.executor.slurm
    is_train = stage == "train"
    env = dict(s.env)  # NeMo-Run exports PYTHONUNBUFFERED=1 itself
    mounts = list(s.container_mounts)
    if s.container_image:
        # Paths in the resolved config are absolute host paths: same path in the container.
        work = str(cfg.work_path)
        if not any(m.split(":")[0] == work for m in mounts):
            mounts.append(f"{work}:{work}")
    else:
        env["PATH"] = _venv_path()  # the job runs this venv (on a shared filesystem)
        if "/nemo_run" in str(job_dir):
            # NeMo-Run rewrites every "/nemo_run" of a host job's sbatch script to the job dir.
            raise UserError([f"work_dir {cfg.work_path} contains '/nemo_run': choose another"])
    nodes, tasks_per_node = stage_tasks(cfg, stage)
    return run.SlurmExecutor(
        account=s.account,
        partition=s.partition or None,
        job_name_prefix=f"{cfg.name}.",
        nodes=nodes,
        ntasks_per_node=tasks_per_node,
        gpus_per_node=s.gpus_per_node if is_train and s.gpus_per_node else None,
        cpus_per_task=stage_cpus(cfg, stage),
        mem=s.mem,
        time=s.time,
        container_image=s.container_image,
        container_mounts=mounts,
        env_vars=env,
        tunnel=slurm_tunnel(cfg, job_dir=job_dir),
        packager=project_packager(),
        # A job whose dependency failed is cancelled, not left pending for ever.
        additional_parameters={"kill_on_invalid_dep": "yes"},
        launcher=run.Torchrun() if is_train else None,
        torchrun_nproc_per_node=tasks_per_node if is_train else None,
        poll_estimated_start_time=False,
    )


def make_executor(cfg: PipelineConfig, *, job_dir: Path, stage: str = "") -> run.Executor:
    if cfg.executor.kind == ExecutorKind.slurm:
        return slurm_executor(cfg, job_dir=job_dir, stage=stage)
    return local_executor(cfg)
