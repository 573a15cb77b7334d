"""The SLURM executor factory: what each stage's job asks for."""

from __future__ import annotations

import sys
from pathlib import Path

import nemo_run as run
import pytest

from pipelines.executors import SHIPPED, slurm_executor, slurm_problems
from schemas.config import PROJECT_ROOT
from schemas.errors import UserError
from schemas.rules import train_nproc_per_node
from tests.conftest import make_config


def _cfg(tmp_path: Path, *overrides: str):
    return make_config(
        tmp_path / "work", "executor.kind=slurm", "executor.slurm.account=a", *overrides
    )


def test_train_job_gets_gpus_and_torchrun_with_nproc_from_config(tmp_path: Path):
    cfg = _cfg(tmp_path, "executor.slurm.nproc_per_node=2", "executor.slurm.nodes=2")
    train = slurm_executor(cfg, job_dir=tmp_path / "jobs", stage="train")
    assert isinstance(train.launcher, run.Torchrun)
    assert train.torchrun_nproc_per_node == 2 and train.nnodes() == 2
    assert train.gpus_per_node == 8
    prepare = slurm_executor(cfg, job_dir=tmp_path / "jobs", stage="prepare")
    assert prepare.launcher is None and prepare.gpus_per_node is None and prepare.nodes == 1
    assert train_nproc_per_node(_cfg(tmp_path)) == 8  # null → one process per GPU
    assert train_nproc_per_node(_cfg(tmp_path, "executor.slurm.gpus_per_node=0")) == 1


def test_connect_job_asks_for_its_tasks_over_its_nodes_and_no_gpu(tmp_path: Path):
    cfg = _cfg(tmp_path, "connect.num_tasks=8", "connect.nodes=2", "connect.num_workers=3")
    connect = slurm_executor(cfg, job_dir=tmp_path / "jobs", stage="connect")
    assert (connect.nodes, connect.ntasks_per_node, connect.cpus_per_task) == (2, 4, 3)
    assert connect.launcher is None and connect.gpus_per_node is None  # srun starts each task
    one = slurm_executor(_cfg(tmp_path), job_dir=tmp_path / "jobs", stage="connect")
    assert (one.nodes, one.ntasks_per_node) == (1, 1)
    with pytest.raises(UserError, match="spread evenly over connect.nodes"):
        _cfg(tmp_path, "connect.num_tasks=3", "connect.nodes=2")


def test_host_jobs_run_this_venv_container_jobs_mount_the_work_dir(tmp_path: Path):
    host = slurm_executor(_cfg(tmp_path), job_dir=tmp_path / "jobs", stage="connect")
    assert host.env_vars["PATH"].startswith(str(Path(sys.executable).parent))
    assert host.container_image is None and isinstance(host.tunnel, run.LocalTunnel)
    cfg = _cfg(tmp_path, "executor.slurm.container_image=img", "executor.slurm.env={A: b}")
    box = slurm_executor(cfg, job_dir=tmp_path / "jobs", stage="connect")
    work = str(cfg.work_path)
    assert f"{work}:{work}" in box.container_mounts
    assert "PATH" not in box.env_vars and box.env_vars["A"] == "b"


def test_project_is_shipped_and_ssh_tunnel_used_when_host_set(tmp_path: Path):
    cfg = _cfg(tmp_path, "executor.slurm.host=login1", "executor.slurm.user=me")
    ex = slurm_executor(cfg, job_dir=tmp_path / "jobs", stage="prepare")
    assert isinstance(ex.tunnel, run.SSHTunnel) and ex.tunnel.host == "login1"
    assert ex.packager.include_pattern == [str(PROJECT_ROOT / n) for n in SHIPPED]
    assert ex.additional_parameters == {"kill_on_invalid_dep": "yes"}


def test_host_job_dir_containing_nemo_run_is_refused(tmp_path: Path):
    with pytest.raises(UserError, match="/nemo_run"):
        slurm_executor(_cfg(tmp_path), job_dir=tmp_path / "nemo_run" / "x", stage="prepare")


def test_local_backend_on_slurm_needs_ranks_that_divide_the_global_batch(tmp_path: Path):
    assert slurm_problems(_cfg(tmp_path, "executor.slurm.nproc_per_node=2")) == []
    problems = slurm_problems(_cfg(tmp_path))  # gpus_per_node 8 → 8 ranks, batch 4
    assert problems == [
        "train.parallel: train.global_batch_size 4 is not divisible by the 8 data-parallel "
        "ranks (the SLURM train job's 8 ranks: nodes 1 × nproc_per_node 8; pipeline_parallel 1, "
        "expert_parallel 1): change train.parallel, executor.slurm.nproc_per_node or "
        "train.global_batch_size (docs/parallel.md)"
    ]
    assert slurm_problems(_cfg(tmp_path, "train.global_batch_size=8")) == []
    megatron = _cfg(tmp_path, "train.backend=megatron")
    assert slurm_problems(megatron) == []
