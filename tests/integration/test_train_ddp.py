"""Data parallel over gloo with 2 ranks: packing stays invisible to the summed gradient,
the ranks read disjoint data, and their weights agree after every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from packline.train.checkpoint import Checkpointer
from packline.train.distributed import torchrun_command
from stages.connect import connect
from stages.prepare import prepare
from stages.validate import validate
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL, check_resume_on_one_process

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_two_ranks_packed_and_unpacked_step_agree(work, tmp_path):
    out = tmp_path / "step.json"
    cmd = torchrun_command(2, "tests.integration.ddp_step_check", [str(work), str(out)])
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["world"] == 2
    a, b = (set(keys) for keys in r["keys_by_rank"])
    assert a and b and not a & b  # each rank read its own shard
    assert max(r["conversations_per_row"]) > 1 and r["padded_tokens_unpacked"] > 0
    assert r["targets_packed"] == r["targets_unpacked"]
    assert abs(r["loss_packed"] - r["loss_unpacked"]) <= 1e-6
    assert r["cosine"] >= 0.99999, r["cosine"]
    assert r["grads_equal_across_ranks"]  # summed, identically on both ranks


#: a set whose epoch outlasts 10 steps of one row per rank: a rank's 400 conversations hold
#: the ~100 it trains plus Energon's shuffle (100) and packing (64) buffers, which already
#: read into the next epoch when the slice is smaller
WIDE = (*SMALL, "data.num_train=800", "train.compare_packing=false")


@pytest.mark.slow
def test_two_rank_stage_reads_disjoint_data_keeps_replicas_equal_and_resumes_on_one_rank(
    tmp_path, capsys
):
    """The ranks read disjoint rows and keep equal weights; the run's last checkpoint (step
    10) resumes on one process (every saved value loads bitwise) and trains on without a
    conversation of the epoch twice."""
    run_work = tmp_path / "work"
    cfg = make_config(run_work, *WIDE)
    prepare(cfg)
    connect(cfg)
    validate(cfg)
    steps = 10
    settings = list(WIDE)
    cmd = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "stage",
        "train",
        f"work_dir={run_work}",
        *settings,
        "train.nproc_per_node=2",
        f"train.max_steps={steps}",
        "train.save_every=2",
        "train.eval_samples=0",
        "mlflow.enabled=false",
        "--force",
    ]
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=900)
    log = run_work / "train" / "packed" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # logged once, by rank 0
    seen = [set(), set()]
    for r in records:
        a, b = (set(keys) for keys in r["keys_by_rank"])
        assert a and b and not a & b
        seen[0] |= a
        seen[1] |= b
        assert len(r["weights_checksums"]) == 2
        assert r["weights_checksums"][0] == r["weights_checksums"][1]
        assert r["train/tokens_real"] == sum(r["row_real_tokens"])  # summed over ranks
    assert not seen[0] & seen[1]  # disjoint over the whole run, not only per step
    result = json.loads((run_work / "train" / "packed" / "result.json").read_text())
    assert result["ranks"] == 2 and result["steps"] == steps
    ckpt = run_work / "train" / "packed" / "checkpoints" / f"step_{steps:06d}"
    saved = Checkpointer(ckpt.parent, keep_last=1).names(ckpt)
    loaders = {"stream/d000of002.state", "stream/d001of002.state"}  # each rank's
    assert loaders <= set(saved)

    # the finished run, rerun on one process by the CLI: the same run dir (the layout is not
    # part of the run's fingerprint), resumed at its end under the new layout, nothing trained
    adapter = run_work / "train" / "packed" / "adapter" / "adapter_model.safetensors"
    exported = load_file(adapter)
    kept = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    one = [
        *cmd[: cmd.index("train.nproc_per_node=2")],
        *cmd[cmd.index("train.nproc_per_node=2") + 1 :],
    ]
    rerun = subprocess.run(one, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert "cannot carry over rank for rank" in " ".join(rerun.stderr.split())
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == kept
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(
        range(1, steps + 1)
    )
    again = load_file(adapter)  # exported from the one process's loaded adapter
    assert sorted(again) == sorted(exported)
    assert all(torch.equal(again[k], exported[k]) for k in exported)

    more = 3
    records = check_resume_on_one_process(
        run_work, [*settings, "train.save_every=2"], step=steps, more=more, capsys=capsys
    )
    before = [k for r in records[:steps] for k in r["keys"]]
    after = [k for r in records[steps:] for k in r["keys"]]
    assert len(set(before)) == len(before)  # the saved run's part of the epoch ...
    assert after and not set(after) & set(before)  # ... not trained again after the resume
    skipped = records[steps]["data/skipped_on_resume"]
    assert 0 < skipped <= len(before)  # read again by the new stream and skipped, counted
