"""The local train backend: packing is invisible to the gradient, and resume is exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from packline.energon.carry import carried_in
from packline.train.checkpoint import Checkpointer
from packline.train.records import read_records
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL, trainer_for


def test_packed_and_unpacked_step_give_the_same_loss_and_gradients(work, tmp_path):
    cfg = make_config(work, *SMALL, "train.global_batch_size=3")
    packed = trainer_for(cfg, True, tmp_path / "p")
    unpacked = trainer_for(cfg, False, tmp_path / "u")
    rows = packed.step_rows()
    assert sum(r.num_conversations for r in rows) > 3  # really several per row
    loss_p, n_p = packed.accumulate_gradients(packed.micro_batches(rows))
    micro_u = unpacked.micro_batches(rows)
    assert sum(m.num_padded_tokens for m in micro_u) > 0  # really padded
    loss_u, n_u = unpacked.accumulate_gradients(micro_u)
    assert n_p == n_u
    assert abs(loss_p - loss_u) <= 1e-6
    gp = torch.cat([p.grad.flatten() for p in packed.params])
    gu = torch.cat([p.grad.flatten() for p in unpacked.params])
    cosine = torch.nn.functional.cosine_similarity(gp.double(), gu.double(), dim=0).item()
    assert cosine >= 0.99999, cosine


def test_unpacked_step_counts_its_own_layout(work, tmp_path):
    """Packing off: one executed row per conversation, its padding, and the nominal FLOPs
    of its physical slots (not of the packed rows its conversations were read from)."""
    cfg = make_config(work, *SMALL, "train.global_batch_size=2")
    unpacked = trainer_for(cfg, False, tmp_path / "u")
    c = unpacked.train_step().counts
    assert c.rows == c.conversations > 2
    assert c.padded_tokens > 0
    assert c.flops_nominal == unpacked.flops_model.nominal(c.tokens_real + c.padded_tokens)


def test_bf16_precision_runs_the_training_forwards_under_autocast(work, tmp_path):
    """``train.precision=bf16`` runs the forwards in bf16 on any device (here the CPU, the
    same autocast code path a GPU takes); ``auto`` keeps the CPU in exact fp32. Weights and
    gradients stay fp32 either way."""
    losses, dtypes = {}, {}
    for precision in ("auto", "bf16"):
        cfg = make_config(work, *SMALL, f"train.precision={precision}")
        trainer = trainer_for(cfg, True, tmp_path / precision)
        q_proj = next(m for n, m in trainer.model.named_modules() if n.endswith("q_proj"))
        seen = []
        hook = q_proj.register_forward_hook(lambda _m, _a, out, seen=seen: seen.append(out.dtype))
        losses[precision], _ = trainer.accumulate_gradients(trainer.step_rows())
        hook.remove()
        dtypes[precision] = set(seen)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainer.params)
    assert dtypes == {"auto": {torch.float32}, "bf16": {torch.bfloat16}}
    assert losses["bf16"] != losses["auto"]  # really computed in another precision ...
    assert losses["bf16"] == pytest.approx(losses["auto"], rel=1e-2)  # ... of the same loss


def _train_cmd(work: Path, *, kill_in_checkpoint: int | None = None) -> list[str]:
    """``packline stage train`` of 20 steps; with ``kill_in_checkpoint``, SIGKILLed while it
    writes that step's checkpoint (after its data file, before DCP commits the metadata)."""
    cli = ["pipelines.cli"]
    if kill_in_checkpoint is not None:
        cli = ["tests.integration.kill_in_checkpoint", str(kill_in_checkpoint), "__0_0.distcp"]
    return [
        sys.executable,
        "-m",
        *cli,
        "stage",
        "train",
        f"work_dir={work}",
        *SMALL,
        "train.compare_packing=false",
        "train.max_steps=20",
        "train.save_every=5",
        "train.keep_last=10",
        "mlflow.enabled=false",
        "--force",
    ]


def _steps(log: Path) -> dict[int, dict]:
    """Complete records by step (the last of a step wins: resume replays), also while the
    run is still writing one."""
    return {rec["step"]: rec for rec in read_records(log)}


def _copy_inputs(src: Path, dst: Path) -> None:
    import shutil

    for name in ("prepare", "connect", "validate"):
        shutil.copytree(src / name, dst / name, symlinks=True)


@pytest.fixture(scope="module")
def straight_work(work, tmp_path_factory) -> Path:
    """The 20-step run trained straight through, once: what each killed-and-resumed run of
    the same config must repeat (the run is deterministic; both kill points compare with it)."""
    straight = tmp_path_factory.mktemp("straight") / "work"
    _copy_inputs(work, straight)
    subprocess.run(
        _train_cmd(straight),
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "COLUMNS": "160"},
        check=True,
        capture_output=True,
        timeout=900,
    )
    return straight


@pytest.mark.slow
@pytest.mark.parametrize("where", ["after_step_10", "while_writing_checkpoint_10"])
def test_resume_after_sigkill_replays_nothing_and_skips_nothing(
    work, straight_work, tmp_path, where
):
    root = Path(__file__).resolve().parents[2]
    killed_work = tmp_path / "killed"
    _copy_inputs(work, killed_work)
    env = {**os.environ, "COLUMNS": "160"}

    kill_at = 10 if where == "while_writing_checkpoint_10" else None
    proc = subprocess.Popen(
        _train_cmd(killed_work, kill_in_checkpoint=kill_at),
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = killed_work / "train" / "packed" / "metrics.jsonl"
    if where == "after_step_10":
        deadline = time.time() + 600
        while time.time() < deadline:
            if (
                log.exists()
                and 10 in _steps(log)
                and (log.parent / "checkpoints" / "step_000010").exists()
            ):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.2)
    assert proc.wait(timeout=600) == -signal.SIGKILL
    ckpts = sorted(p.name for p in (log.parent / "checkpoints").iterdir())
    if where == "while_writing_checkpoint_10":
        assert "step_000010" not in ckpts and ".tmp-step_000010" in ckpts  # torn write left aside
    else:  # what a kill in the middle of a log record leaves: the resume must start clean
        with log.open("a") as f:
            f.write('{"step": 11, "train/loss": 1.0, "ke')
    subprocess.run(
        _train_cmd(killed_work),
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        timeout=900,
    )

    straight = _steps(straight_work / "train" / "packed" / "metrics.jsonl")
    resumed = _steps(log)
    # carry-over is on (the default config): samples were waiting in the loader at step 10,
    # so the resume restored them, not just a position in the stream
    checkpoints = Checkpointer(straight_work / "train" / "packed" / "checkpoints", keep_last=10)
    at_10 = checkpoints.read(checkpoints.root / "step_000010", "stream/d000of001")
    assert carried_in(at_10["stream/d000of001"]["loader"])
    assert sorted(resumed) == list(range(1, 21))
    for step in range(11, 21):
        assert resumed[step]["train/loss"] == straight[step]["train/loss"], step  # bitwise
        assert resumed[step]["keys"] == straight[step]["keys"], step


def test_checkpoints_of_another_config_are_not_resumed(tmp_path):
    from stages.train import _claim_run_dir

    run = tmp_path / "packed"
    _claim_run_dir(run, "fp-a")
    (run / "checkpoints" / "step_000005").mkdir(parents=True)
    _claim_run_dir(run, "fp-a")  # same config: resume
    assert (run / "checkpoints" / "step_000005").is_dir()
    _claim_run_dir(run, "fp-b")  # another config: start fresh
    assert not (run / "checkpoints").exists()
    assert (run / "fingerprint").read_text() == "fp-b"


def test_rerunning_a_finished_run_resumes_at_its_end_and_trains_nothing(work, tmp_path):
    """A run whose last step is not a ``save_every`` step saves it at the end; rerunning it
    (``packline stage train --force`` on the same config) resumes from that checkpoint,
    trains no step, evaluates and ends, leaving the checkpoint as it was."""
    cfg = make_config(work, *SMALL, "train.max_steps=2", "train.save_every=20")
    run = tmp_path / "p"
    run.mkdir()  # the stage claims the run dir (stages/train.py): here the test does
    trainer_for(cfg, True, run).train()
    (last,) = sorted((run / "checkpoints").iterdir())
    assert last.name == "step_000002"
    state = {p.name: p.read_bytes() for p in last.iterdir()}
    again = trainer_for(cfg, True, run)
    again.train()
    assert again.step == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert {p.name: p.read_bytes() for p in last.iterdir()} == state
    assert [r["step"] for r in read_records(run / "metrics.jsonl")] == [1, 2]
