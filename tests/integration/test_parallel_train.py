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
from torch.distributed.checkpoint import FileSystemReader

from packline.train.records import read_records
from stages.connect import connect
from stages.prepare import prepare
from stages.validate import validate
from tests.conftest import make_config
from tests.integration.train_helpers import check_resume_on_one_process

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
KILL_AFTER = 2
#: EP2 runs to step 10, whose checkpoint then resumes on one process (the issue's check)
STEPS = {"ep2": 10, "pp2": 4}


@pytest.fixture(scope="module")
def moe_work(tmp_path_factory) -> Path:
    """The small set prepared and connected once for the tiny MoE with fixed-width rows."""
    work = tmp_path_factory.mktemp("parallel") / "work"
    cfg = make_config(work, *MOE)
    prepare(cfg)
    connect(cfg)
    validate(cfg)
    return work


def _train_cmd(work: Path, layout: str) -> list[str]:
    steps = STEPS[layout]
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
        f"train.max_steps={steps}",
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
    moe_work: Path, tmp_path: Path, layout: str, capsys
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
    steps = STEPS[layout]
    assert max(_steps(run_dir / "metrics.jsonl")) < steps
    subprocess.run(
        _train_cmd(killed, layout), cwd=ROOT, env=env, check=True, capture_output=True, timeout=900
    )

    done = _steps(straight / "train" / "packed" / "metrics.jsonl")
    resumed = _steps(run_dir / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in range(KILL_AFTER + 1, steps + 1):
        assert resumed[step]["train/loss"] == done[step]["train/loss"], step  # bitwise
        assert resumed[step]["keys"] == done[step]["keys"], step
        assert resumed[step]["moe/aux_loss"] == done[step]["moe/aux_loss"], step

    for r in done.values():
        # rows counted once per data-parallel index (PP: both stages read the same rows)
        assert r["train/tokens_real"] == sum(r["row_real_tokens"])
        assert len(r["keys_by_rank"]) == (2 if layout == "ep2" else 1)
        assert r["moe/expert_load_min"] <= 1.0 <= r["moe/expert_load_max"]
    # each rank saved the adapters it owns (its experts' slices, its stage's layers), under
    # layout-free names: DCP's metadata says which rank's file holds each
    ckpt = straight / "train" / "packed" / "checkpoints" / f"step_{steps:06d}"
    storage = FileSystemReader(ckpt).read_metadata().storage_data
    writer = {
        i.fqn: info.relative_path for i, info in storage.items() if i.fqn.startswith("adapter.")
    }
    if layout == "pp2":  # stage 0 holds the first decoder layer, stage 1 the second
        for name, file in writer.items():
            if ".layers." in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                assert file == f"__{layer}_0.distcp", name
    else:  # 8 experts over 2 ranks: experts 0-3 on rank 0, 4-7 on rank 1
        experts = {n: f for n, f in writer.items() if "@expert" in n}
        assert {int(n.rsplit("@expert", 1)[1]) for n in experts} == set(range(8))
        for name, file in experts.items():
            assert file == f"__{int(name.rsplit('@expert', 1)[1]) // 4}_0.distcp", name
    # ... and the exported adapter is the whole one-process PEFT adapter
    config = json.loads(
        (straight / "train" / "packed" / "adapter" / "adapter_config.json").read_text()
    )
    assert sorted(config["target_parameters"]) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
    ]

    # the last checkpoint resumes on one process: every saved value loads bitwise (EP2's two
    # loaders cannot carry over to one, PP2's one does), and it trains on
    one = [o for o in MOE if o != "train.nproc_per_node=2"]
    check_resume_on_one_process(
        straight, one, step=steps, more=2, capsys=capsys, restarts_stream=layout == "ep2"
    )


def test_the_sample_loss_is_each_conversations_mean_averaged_on_every_layout(moe_work: Path):
    """``train.loss: sample`` on DP 2, FSDP 2, EP 2 and PP 2 (one launch of 2 ranks): the trainer's
    loss of one step, packed and unpacked, is the mean over the step's conversations (every
    rank's) of each one's mean token loss, each run alone on one process."""
    from packline.train.distributed import torchrun_command

    out = moe_work.parent / "loss_layouts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [str(moe_work), str(out), *MOE]
    cmd = torchrun_command(2, "tests.integration.loss_layouts_check", args)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1))  # the figures, for the record (pytest -s)
    assert sorted(results) == ["dp2", "ep2", "fsdp2", "pp2"]
    for layout, r in results.items():
        ref = r["reference"]
        assert max(r["conversations_per_row"]) > 1, layout  # rows hold several conversations
        assert abs(r["loss_packed"] - ref["sample"]) <= 1e-6, (layout, r)
        if layout != "pp2":  # PP trains packed rows only
            assert abs(r["loss_unpacked"] - r["loss_packed"]) <= 1e-6, (layout, r)
        assert abs(ref["sample"] - ref["token"]) > 1e-4, layout  # the two weightings differ
