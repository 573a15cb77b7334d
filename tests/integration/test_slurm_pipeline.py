"""The tiny pipeline on a real single-node SLURM cluster on localhost.

``scripts/slurm-local.sh`` installs (apt, first time only) and starts munge, MariaDB, slurmdbd,
slurmctld and slurmd with 8 fake GPUs, all state in a fresh dir; ``packline run --executor
slurm`` submits one batch job per stage, each after the previous one succeeds; the test checks
the jobs in SLURM's accounting, the MLflow store, the gathered logs, and that stopping the
cluster leaves no daemon behind.

The default pipeline's connect job runs as 2 SLURM tasks, whose merged table must equal
connect as one task. Its train job asks for 2 of the fake GPUs and runs under torchrun with 2
processes, which train data parallel over gloo (no real GPU here). Two MoE pipelines follow:
the 30B-A3B EP8 cluster config trained by the local backend on the tiny MoE (EP 8 on 8
ranks), and PP 2 × EP 2 on 4 ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint import FileSystemReader

from schemas.config import PROJECT_ROOT

pytestmark = pytest.mark.slow

SCRIPT = PROJECT_ROOT / "scripts" / "slurm-local.sh"
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
NEEDED = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd")
QUICK = [
    "data.num_train=30",
    "data.num_val=4",
    "prepare.num_workers=1",
    "train.max_steps=2",
    "train.save_every=1",
    "train.global_batch_size=2",
    "train.eval_samples=1",
    "train.compare_packing=false",
]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        sudo = shutil.which("sudo")
        if not sudo or subprocess.run([sudo, "-n", "true"], capture_output=True).returncode:
            return "needs root or passwordless sudo to install and start SLURM"
    if not all(shutil.which(b) for b in NEEDED) and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    return None


def _free_port_base(count: int = 4) -> int:
    """A base port with ``count`` consecutive free ports (another cluster may hold 6817…)."""
    for base in range(26817, 27817, 10):
        try:
            socks = []
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports for the local cluster")


class LocalSlurm:
    def __init__(self, state: Path, port_base: int):
        self.state = state
        self.env = {
            **os.environ,
            "PACKLINE_SLURM_PORT_BASE": str(port_base),
            "SLURM_CONF": str(state / "etc" / "slurm.conf"),
        }
        self.stopped = False
        self.start_seconds = 0.0

    def script(self, command: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SCRIPT), command, str(self.state)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def daemon_pids(self) -> dict[str, int]:
        files = {
            "munged": self.state / "munge" / "munged.pid",
            "mariadbd": self.state / "mysql" / "run" / "mariadbd.pid",
            **{d: self.state / "pid" / f"{d}.pid" for d in ("slurmdbd", "slurmctld", "slurmd")},
        }
        return {d: int(f.read_text().strip()) for d, f in files.items() if f.is_file()}

    def stop(self) -> subprocess.CompletedProcess:
        result = self.script("stop", timeout=180)
        self.stopped = True
        return result


def _running(pid: int) -> bool:
    """A live process (a zombie waiting to be reaped has stopped running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def local_slurm():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    state = Path(tempfile.mkdtemp(prefix="packline-slurm-", dir="/tmp"))
    state.chmod(0o755)  # the munge and mysql users must reach their dirs inside
    cluster = LocalSlurm(state, _free_port_base())
    t0 = time.perf_counter()
    started = cluster.script("start")
    cluster.start_seconds = time.perf_counter() - t0
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield cluster
    finally:
        if not cluster.stopped:
            cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


def _sacct(cluster: LocalSlurm, fields: str, ids: list[str] = ()) -> list[list[str]]:
    """The cluster's jobs today, or the jobs ``ids`` (a job cancelled before it was eligible
    is listed only by id)."""
    select = ["-j", ",".join(ids)] if ids else []
    out = subprocess.run(
        ["sacct", "--parsable2", "--noheader", "-X", *select, "-o", fields],
        env=cluster.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split("|") for line in out.splitlines() if line]


def _slurm_command(args: list[str], *, ranks: int) -> list[str]:
    """``packline run ARGS --executor slurm`` on the local cluster, the train job on
    ``ranks`` of its fake GPUs with one process each."""
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "run",
        *args,
        "executor.slurm.account=packline",
        "executor.slurm.partition=debug",
        f"executor.slurm.gpus_per_node={ranks}",
        f"executor.slurm.nproc_per_node={ranks}",
        "--executor",
        "slurm",
    ]


def _run_on_slurm(cluster: LocalSlurm, args: list[str], *, ranks: int):
    return subprocess.run(
        _slurm_command(args, ranks=ranks),
        env={**cluster.env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=PROJECT_ROOT,
    )


def test_pipeline_on_local_slurm_runs_stages_in_order(local_slurm: LocalSlurm, tmp_path: Path):
    work = tmp_path / "work"
    t0 = time.perf_counter()
    # connect as 2 tasks of its job (srun starts both; the one that finishes last merges)
    result = _run_on_slurm(
        local_slurm, [f"work_dir={work}", *QUICK, "connect.num_tasks=2"], ranks=2
    )
    run_seconds = time.perf_counter() - t0
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert (
        "pipeline finished: prepare SUCCEEDED, connect SUCCEEDED, validate SUCCEEDED, "
        "train SUCCEEDED" in out
    )

    # SLURM accounting: one job per stage, each started after the previous one ended.
    jobs = [
        r
        for r in _sacct(local_slurm, "JobID,JobName,State,Start,End,AllocTRES")
        if r[1].startswith("tiny_cpu.")
    ]
    stages = ["prepare", "connect", "validate", "train"]
    assert [r[1] for r in jobs] == [f"tiny_cpu.{stage}" for stage in stages]
    assert [r[2] for r in jobs] == ["COMPLETED"] * 4
    assert [int(r[0]) for r in jobs] == sorted(int(r[0]) for r in jobs)
    for before, after in zip(jobs, jobs[1:], strict=False):
        assert after[3] >= before[4], (before, after)  # ISO timestamps compare as text
    assert "gres/gpu=2" in jobs[3][5] and "gres/gpu" not in jobs[0][5]
    _check_connect_as_two_tasks(local_slurm, work, tmp_path / "one_task", jobs[1][0])

    # Each job's logs were gathered; the train job ran under torchrun.
    for stage in stages:
        assert list((work / "logs" / stage).glob("log-*.out")), stage
    train_log = next((work / "logs" / "train").glob("log-*.out")).read_text()
    assert "torch/distributed/elastic" in train_log

    # MLflow (sqlite in the shared work dir): a parent run, a child per stage, the train run.
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if r.data.tags.get("packline.kind") == "pipeline")
    assert parent.info.status == "FINISHED"
    children = {
        r.data.tags["mlflow.runName"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert sorted(children) == ["connect", "prepare", "train", "validate"]
    assert all(c.info.status == "FINISHED" for c in children.values())
    nested = [
        r for r in runs if r.data.tags.get("mlflow.parentRunId") == children["train"].info.run_id
    ]
    assert [r.data.tags["mlflow.runName"] for r in nested] == ["train-packed"]
    history = client.get_metric_history(nested[0].info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2]  # logged once, by rank 0

    # Two data-parallel ranks over gloo: disjoint data, equal weights after every step.
    result = json.loads((work / "train" / "packed" / "result.json").read_text())
    assert result["ranks"] == 2
    for line in (work / "train" / "packed" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        a, b = (set(keys) for keys in record["keys_by_rank"])
        assert a and b and not a & b
        assert record["weights_checksums"][0] == record["weights_checksums"][1]

    print(
        f"\nlocal SLURM start {local_slurm.start_seconds:.1f} s (incl. any apt install), "
        f"pipeline {run_seconds:.1f} s"
    )


def _check_connect_as_two_tasks(
    local_slurm: LocalSlurm, work: Path, one_task: Path, job_id: str
) -> None:
    """The connect job ran as 2 SLURM tasks, each measuring its share, and its table equals
    connect as 1 task on the same data (prepared and connected here, in this process)."""
    import pandas as pd

    from schemas.config import load_config
    from stages.connect import connect
    from stages.prepare import prepare

    steps = subprocess.run(
        ["sacct", "--parsable2", "--noheader", "-j", job_id, "-o", "JobID,NTasks,State"],
        env=local_slurm.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert any(
        line.split("|")[1:] == ["2", "COMPLETED"] for line in steps if ".batch" not in line
    ), steps  # the srun step of the stage: 2 tasks
    record = json.loads((work / "connect" / "_COMPLETE.json").read_text())
    tasks = record["summary"]["tasks"]
    assert [(t["rank"], t["world"]) for t in tasks] == [(0, 2), (1, 2)]
    assert all(t["samples"] > 0 and t["attempt"] == f"slurm-{job_id}-0" for t in tasks)
    assert not (work / "connect.parts").exists()
    cfg = load_config(None, [f"work_dir={one_task}", *QUICK, "mlflow.enabled=false"])
    prepare(cfg)
    alone = connect(cfg)
    pd.testing.assert_frame_equal(
        pd.read_parquet(work / "connect" / "lengths.parquet"),
        pd.read_parquet(alone.out_dir / "lengths.parquet"),
    )


MOE_CONFIG = PROJECT_ROOT / "configs" / "qwen3_vl_30b_a3b_lora_ep8_slurm.yaml"
#: the 30B-A3B EP8 cluster config, trained by the local backend on the tiny MoE of this
#: machine: the cluster's paths and container replaced, the same layout (EP 8 on 8 ranks)
TINY_LOCAL = [
    "train.backend=local",
    "model.path=null",
    "model.name=tiny",
    "processor.path=null",
    "packing.seq_length=1024",
    "prepare.samples_per_shard=100",
    "executor.slurm.container_image=null",
    "executor.slurm.container_mounts=[]",
    "executor.slurm.env={}",
    "train.num_workers=0",
    # connect as 2 tasks of one worker, not the cluster's 8 of 4: each task loads torch and
    # the processor, ~6 CPU-seconds on this machine's 2 cores; the pipeline test above checks
    # that connect's SLURM tasks give one task's table
    "connect.num_tasks=2",
    "connect.num_workers=1",
]
LAYOUTS = {
    # (config, overrides, ranks)
    "ep8": (MOE_CONFIG, [*TINY_LOCAL, "train.global_batch_size=8"], 8),
    "pp2_ep2": (
        None,
        [
            "model.moe=true",
            "model.path=null",
            "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,lm_head]",
            "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
            "packing.pad_to_max_length=true",
            "train.parallel.pipeline_parallel=2",
            "train.parallel.expert_parallel=2",
            "train.global_batch_size=4",
        ],
        4,
    ),
}


def test_moe_layouts_train_on_local_slurm(local_slurm: LocalSlurm, tmp_path: Path):
    # Both pipelines are submitted at once (SLURM runs their train jobs one after the other:
    # together they ask for 12 of the 8 fake GPUs); each one's jobs run in dependency order.
    procs = {}
    for layout, (config, overrides, ranks) in LAYOUTS.items():
        work, name = tmp_path / layout / "work", f"moe_{layout}"
        args = [*([str(config)] if config else []), f"name={name}", f"work_dir={work}", *QUICK]
        log = (tmp_path / f"{layout}.log").open("w")
        procs[layout] = subprocess.Popen(
            _slurm_command([*args, *overrides], ranks=ranks),
            env={**local_slurm.env, "COLUMNS": "200"},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
        )
    for layout, proc in procs.items():
        code = proc.wait(timeout=1500)
        assert code == 0, (tmp_path / f"{layout}.log").read_text()[-5000:]
    for layout, (_, _, ranks) in LAYOUTS.items():
        _check_moe_run(local_slurm, tmp_path / layout / "work", f"moe_{layout}", ranks)


def _check_moe_run(local_slurm: LocalSlurm, work: Path, name: str, ranks: int) -> None:
    jobs = [
        r for r in _sacct(local_slurm, "JobID,JobName,State,Start,End") if r[1].startswith(name)
    ]
    assert [r[1] for r in jobs] == [
        f"{name}.{s}" for s in ("prepare", "connect", "validate", "train")
    ]
    assert [r[2] for r in jobs] == ["COMPLETED"] * 4
    for before, after in zip(jobs, jobs[1:], strict=False):
        assert after[3] >= before[4], (before, after)  # each after the previous one ended

    run_dir = work / "train" / "packed"
    summary = json.loads((run_dir / "result.json").read_text())
    assert summary["ranks"] == ranks
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # the rows of every data-parallel index, counted once
        assert r["train/tokens_real"] == sum(r["row_real_tokens"])
        assert r["moe/aux_loss"] > 0 and r["moe/expert_load_min"] <= 1 <= r["moe/expert_load_max"]
    # each rank saved the part of the adapters it owns (DCP's metadata says which rank's file
    # holds each value: every rank's holds some); the exported adapter is whole
    step = run_dir / "checkpoints" / "step_000002"
    storage = FileSystemReader(step).read_metadata().storage_data
    files = {info.relative_path for i, info in storage.items() if i.fqn.startswith("adapter.")}
    assert files == {f"__{r}_0.distcp" for r in range(ranks)}
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()

    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    train = next(r for r in runs if r.data.tags.get("mlflow.runName") == "train-packed")
    assert train.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(train.info.run_id, "moe/aux_loss")] == [1, 2]


def test_a_failed_prepare_job_cancels_the_later_jobs(local_slurm: LocalSlurm, tmp_path: Path):
    """afterok with kill_on_invalid_dep: the jobs after a failed one are cancelled, never
    started; packline run exits 2 with prepare's reason first and the rest shown SKIPPED."""
    source = tmp_path / "bad"
    source.mkdir()
    (source / "conversations.jsonl").write_text('not json\n{"id": "a"}\n')
    work = tmp_path / "work"
    args = [f"work_dir={work}", "name=badsource", f"data.source={source}", *QUICK]
    result = _run_on_slurm(local_slurm, args, ranks=1)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-5000:]
    lines = [line.strip("│ ") for line in out.splitlines()]
    top = next(i for i, line in enumerate(lines) if line.startswith("prepare failed: "))
    assert "prepare: no usable rows" in lines[top]
    for stage in ("connect", "validate", "train"):
        row = next(line for line in lines[top + 1 :] if line.startswith(stage + " "))
        assert "SKIPPED" in row and "not started: prepare failed" in row
    # sacct lists a job cancelled before it was eligible only when asked for it by id
    # (the run's "SLURM jobs (sacct)" table names every job it submitted)
    ids = re.findall(r"(?m)^│ (?:prepare|connect|validate|train) +│ (\d+) +│", out)
    jobs = _sacct(local_slurm, "JobID,JobName,State,Start", ids)
    assert [r[1] for r in jobs] == [
        f"badsource.{s}" for s in ("prepare", "connect", "validate", "train")
    ]
    assert jobs[0][2] == "FAILED"
    assert [r[2] for r in jobs[1:]] == ["CANCELLED"] * 3, jobs
    assert all(r[3] in ("None", "Unknown") for r in jobs[1:]), jobs  # never started
    assert not (work / "connect").exists()


def test_stopping_the_cluster_leaves_no_daemon(local_slurm: LocalSlurm):
    pids = local_slurm.daemon_pids()
    assert sorted(pids) == sorted(DAEMONS)
    stopped = local_slurm.stop()
    assert stopped.returncode == 0, stopped.stderr
    assert [d for d, pid in pids.items() if _running(pid)] == []
