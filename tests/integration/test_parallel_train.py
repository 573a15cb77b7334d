"""The train stage under expert and pipeline parallelism, end to end over gloo: exact resume
after a SIGKILL, per-rank checkpoints, router statistics logged per step, the whole adapter
exported. (Each layout's equality with one process, loss and every gradient, is checked in
test_expert_parallel.py and test_pipeline_parallel.py on the engines themselves.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from packline.train.records import read_records
from stages.connect import connect_processor
from stages.prepare import prepare_dataset
from stages.validate import validate_config
from tests.conftest import make_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MOE = (
    "data.num_train=120",
    "data.num_val=8",
    "model.moe=true",
    "model.path=null",  # the tiny MoE at random init (the shipped base is dense)
    "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,lm_head]",
    "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
    "packing.pad_to_max_length=true",
    "train.global_batch_size=4",
    "train.eval_samples=0",
    "train.compare_packing=false",
    "train.nproc_per_node=2",
)
LAYOUTS = {
    "ep2": ["train.parallel.expert_parallel=2"],
    "pp2": ["train.parallel.pipeline_parallel=2", "train.parallel.schedule=1f1b"],
}
STEPS, KILL_AFTER = 4, 2


@pytest.fixture(scope="module")
def moe_work(tmp_path_factory) -> Path:
    """The small set prepared and connected once for the tiny MoE with fixed-width rows."""
    work = tmp_path_factory.mktemp("parallel") / "work"
    cfg = make_config(work, *MOE)
    prepare_dataset(cfg)
    connect_processor(cfg)
    validate_config(cfg)
    return work


def _train_cmd(work: Path, layout: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "stage",
        "train",
        f"work_dir={work}",
        "prepare.num_workers=1",
        *MOE,
        *LAYOUTS[layout],
        f"train.max_steps={STEPS}",
        f"train.save_every={KILL_AFTER}",
        "train.keep_last=10",
        "mlflow.enabled=false",
        "--force",
    ]


def _copy_inputs(src: Path, dst: Path) -> None:
    import shutil

    for name in ("prepare", "connect", "validate"):
        shutil.copytree(src / name, dst / name, symlinks=True)


def _steps(log: Path) -> dict[int, dict]:
    return {rec["step"]: rec for rec in read_records(log)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sigkill_after_a_checkpoint_then_resume_repeats_the_run_bitwise(
    moe_work: Path, tmp_path: Path, layout: str
):
    env = {**os.environ, "COLUMNS": "160", "OMP_NUM_THREADS": "1"}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for w in (straight, killed):
        _copy_inputs(moe_work, w)
    subprocess.run(
        _train_cmd(straight, layout),
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=900,
    )

    # the same run, every process of the launch SIGKILLed once checkpoint 3 is complete
    proc = subprocess.Popen(
        _train_cmd(killed, layout),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the launcher and both ranks
    )
    run_dir = killed / "train" / "packed"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        ckpt = run_dir / "checkpoints" / f"step_{KILL_AFTER:06d}"
        if ckpt.is_dir() and KILL_AFTER in _steps(run_dir / "metrics.jsonl"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert max(_steps(run_dir / "metrics.jsonl")) < STEPS
    subprocess.run(
        _train_cmd(killed, layout), cwd=ROOT, env=env, check=True, capture_output=True, timeout=900
    )

    done = _steps(straight / "train" / "packed" / "metrics.jsonl")
    resumed = _steps(run_dir / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(KILL_AFTER + 1, STEPS + 1):
        assert resumed[step]["train/loss"] == done[step]["train/loss"], step  # bitwise
        assert resumed[step]["keys"] == done[step]["keys"], step
        assert resumed[step]["moe/aux_loss"] == done[step]["moe/aux_loss"], step

    for r in done.values():
        # rows counted once per data-parallel index (PP: both stages read the same rows)
        assert r["train/tokens_real"] == sum(r["row_real_tokens"])
        assert len(r["keys_by_rank"]) == (2 if layout == "ep2" else 1)
        assert r["moe/expert_load_min"] <= 1.0 <= r["moe/expert_load_max"]
    # each rank saved the adapters it owns (its experts' slices, its stage's layers) ...
    ckpt = straight / "train" / "packed" / "checkpoints" / f"step_{STEPS:06d}"
    parts = [torch.load(ckpt / f"adapter_rank{r:03d}.pt") for r in range(2)]
    names = [set(p) - {"__packline_expert_slices__"} for p in parts]
    if layout == "pp2":
        assert names[0] and names[1] and not names[0] & names[1]  # disjoint stages
    else:
        assert names[0] == names[1]  # the same names, each rank its experts' slice
        expert = next(n for n in names[0] if ".experts." in n and "lora_A" in n)
        assert not torch.equal(parts[0][expert], parts[1][expert])
    # ... and the exported adapter is the whole one-process PEFT adapter
    config = json.loads(
        (straight / "train" / "packed" / "adapter" / "adapter_config.json").read_text()
    )
    assert sorted(config["target_parameters"]) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
    ]
