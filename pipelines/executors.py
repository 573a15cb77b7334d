"""NeMo-Run executor factories from the config: small functions with defaults."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nemo_run as run

from schemas.config import ExecutorKind, PipelineConfig


def _venv_path() -> str:
    """PATH with this interpreter's bin first: NeMo-Run starts tasks with plain ``python``."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def local_executor(cfg: PipelineConfig) -> run.LocalExecutor:
    """Run each stage as a local subprocess of this machine, in this venv."""
    return run.LocalExecutor(env_vars={"PATH": _venv_path(), "PYTHONUNBUFFERED": "1"})


def slurm_executor(cfg: PipelineConfig, *, job_dir: Path) -> run.SlurmExecutor:
    """SLURM executor: LocalTunnel from this machine, or SSHTunnel when ``slurm.host`` is set."""
    s = cfg.executor.slurm
    if s.host:
        tunnel = run.SSHTunnel(
            host=s.host,
            user=s.user or os.environ.get("USER", ""),
            job_dir=s.job_dir or str(job_dir),
        )
    else:
        tunnel = run.LocalTunnel(job_dir=str(job_dir))
    return run.SlurmExecutor(
        account=s.account,
        partition=s.partition or None,
        nodes=1,
        ntasks_per_node=1,
        time=s.time,
        container_image=s.container_image,
        container_mounts=list(s.container_mounts),
        env_vars={"PATH": _venv_path(), **dict(s.env)},
        tunnel=tunnel,
    )


def make_executor(cfg: PipelineConfig, *, job_dir: Path) -> run.Executor:
    if cfg.executor.kind == ExecutorKind.slurm:
        return slurm_executor(cfg, job_dir=job_dir)
    return local_executor(cfg)
