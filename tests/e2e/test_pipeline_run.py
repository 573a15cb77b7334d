"""`packline run` as a user runs it: a subprocess, NeMo-Run tasks, a real sqlite MLflow store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

PACKLINE = [sys.executable, "-m", "pipelines.cli"]
# Train just enough to run every part of the stage (both modes, a checkpoint, eval loss).
QUICK_TRAIN = [
    "train.max_steps=2",
    "train.save_every=1",
    "train.global_batch_size=2",
    "train.eval_samples=2",
]


def _run(work: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(
        [*PACKLINE, "run", f"work_dir={work}", "prepare.num_workers=1", *QUICK_TRAIN, *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )


def _record(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "_COMPLETE.json").read_text())


def test_run_twice_skips_then_a_changed_sample_count_reruns(tmp_path: Path):
    work = tmp_path / "work"
    small = ["data.num_train=40", "data.num_val=6"]

    first = _run(work, *small)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout + first.stderr
    # one NeMo-Run experiment per stage, each started after the one before succeeded
    starts = [
        out.index(f"Task 0: {stage}") for stage in ("prepare", "connect", "validate", "train")
    ]
    assert starts == sorted(starts)
    flat = " ".join(out.split())
    assert (
        "pipeline finished: prepare SUCCEEDED, connect SUCCEEDED, validate SUCCEEDED, "
        "train SUCCEEDED" in flat
    )
    assert "validate: all" in out and "rules hold" in out
    report = json.loads((work / "validate" / "report.json").read_text())
    assert report["ok"] and report["errors"] == [] and report["warnings"] == []
    prep1, conn1 = _record(work, "prepare"), _record(work, "connect")
    assert len(pd.read_parquet(work / "connect" / "lengths.parquet")) == 46

    second = _run(work, *small)
    assert second.returncode == 0, second.stderr[-3000:]
    out2 = second.stdout + second.stderr
    assert "prepare: up to date" in out2 and "connect: up to date" in out2
    assert "validate: up to date" in out2 and "train: up to date" in out2
    assert "Task 0: " not in out2  # nothing launched
    assert _record(work, "prepare") == prep1 and _record(work, "connect") == conn1

    # (packing off is not trained again here: the first run's train stage is checked below)
    third = _run(work, "data.num_train=50", "data.num_val=6", "train.compare_packing=false")
    assert third.returncode == 0, third.stderr[-3000:]
    prep3, conn3 = _record(work, "prepare"), _record(work, "connect")
    assert prep3["fingerprint"] != prep1["fingerprint"]
    assert conn3["fingerprint"] != conn1["fingerprint"]
    assert prep3["metrics"]["prepare/train_samples"] == 50
    assert len(pd.read_parquet(work / "connect" / "lengths.parquet")) == 56

    # The sqlite store: one parent per pipeline run, a child per stage, named metrics.
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny_cpu")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("packline.kind") == "pipeline"]
    assert len(parents) == 3
    assert all(p.info.status == "FINISHED" for p in parents)
    for parent in parents:
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(c.data.tags["mlflow.runName"] for c in children) == [
            "connect",
            "prepare",
            "train",
            "validate",
        ]
        for child in children:
            assert child.data.params["packing.seq_length"] == "2048"
    latest = max(parents, key=lambda r: r.info.start_time)
    kids = {
        r.data.tags["mlflow.runName"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == latest.info.run_id
    }
    assert kids["prepare"].data.metrics["prepare/train_samples"] == 50
    assert kids["prepare"].data.tags["packline.skipped"] == "false"
    assert kids["connect"].data.metrics["connect/samples"] == 56
    assert 0 < kids["connect"].data.metrics["connect/forecast_fill_b64"] <= 1
    assert latest.data.metrics["connect/samples"] == 56
    artifacts = {a.path for a in client.list_artifacts(kids["connect"].info.run_id)}
    assert {"forecast.json", "length_histogram.png"} <= artifacts
    assert "rejects.jsonl" in {a.path for a in client.list_artifacts(kids["prepare"].info.run_id)}
    assert kids["validate"].data.metrics["validate/errors"] == 0
    assert {"report.json", "pipeline.yaml"} <= {
        a.path for a in client.list_artifacts(kids["validate"].info.run_id)
    }

    # Training runs nest under the train stage: packing on and off, per-step metrics.
    def train_runs_of(parent) -> tuple:
        stage = next(
            r
            for r in runs
            if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
            and r.data.tags["mlflow.runName"] == "train"
        )
        return stage, {
            r.data.tags["mlflow.runName"]: r
            for r in runs
            if r.data.tags.get("mlflow.parentRunId") == stage.info.run_id
        }

    assert sorted(train_runs_of(latest)[1]) == ["train-packed"]
    first_parent = min(parents, key=lambda r: r.info.start_time)
    first_train, train_runs = train_runs_of(first_parent)
    assert sorted(train_runs) == ["train-packed", "train-unpacked"]
    for run in train_runs.values():  # adapter, resolved config, pack-fill histogram
        logged = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"adapter", "config.yaml", "pack_fill.png"} <= logged, logged
    history = client.get_metric_history(train_runs["train-packed"].info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2]
    assert "compare/speedup_real_tokens_per_s" in first_train.data.metrics


def test_run_with_bad_overrides_exits_2_listing_both(tmp_path: Path):
    result = _run(tmp_path / "work", "packing.seq_lenght=10", "packing.seq_length=big")
    assert result.returncode == 2
    assert "2 problem(s)" in result.stderr
    assert "did you mean 'seq_length'" in result.stderr and "expected int" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_stops_at_validate_with_exit_2_listing_every_error(tmp_path: Path):
    """The MoE silent no-op (dense LoRA targets on 3-D experts) and an overlength policy that
    would stop the run are caught by validate, together, before train starts."""
    work = tmp_path / "work"
    result = _run(
        work,
        "data.num_train=40",
        "data.num_val=6",
        "model.moe=true",
        "model.path=null",  # the tiny MoE at random: the shipped base is dense
        "packing.seq_length=256",
        "packing.overlength=fail",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "validate: 4 error(s)" in result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 4
    assert "and packing.overlength is 'fail'" in problems[0]
    assert [p.split("'")[1] for p in problems[1:]] == ["gate_proj", "up_proj", "down_proj"]
    assert "Traceback" not in result.stderr
    assert (work / "validate" / "report.json").is_file()
    assert not (work / "validate" / "_COMPLETE.json").exists()
    assert not (work / "train").exists()
