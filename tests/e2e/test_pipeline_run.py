"""`packline run` as a user runs it: a subprocess, NeMo-Run tasks, a real sqlite MLflow store."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from peft import PeftModel
from transformers import AutoModelForImageTextToText

from schemas.config import TINY_BASE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PACKLINE = [sys.executable, "-m", "pipelines.cli"]
COLUMNS = 100  # what the console is given (as a terminal of 100 columns would)
# Train just enough to run every part of the stage (both modes, a checkpoint, eval loss).
QUICK_TRAIN = [
    "train.max_steps=2",
    "train.save_every=1",
    "train.global_batch_size=2",
    "train.eval_samples=2",
]


def _run(work: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(COLUMNS)}
    return subprocess.run(
        [*PACKLINE, "run", f"work_dir={work}", "prepare.num_workers=1", *QUICK_TRAIN, *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )


@pytest.fixture
def short_tmp():
    """A work dir with a short path (not pytest's long tmp_path): the printed next steps,
    which name it, then fit the console's width as they do under ``runs/``."""
    path = Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _next_steps(out: str) -> dict[str, str]:
    block = out.split("next steps\n", 1)[1].splitlines()
    steps = {}
    for line in block:
        if not line.startswith("  "):
            break
        what, text = re.split(r" {2,}", line.strip(), maxsplit=1)
        steps[what] = text.split("   #")[0]
    return steps


def _command(text: str) -> list[str]:
    """A printed command as argv: the test's own interpreter runs ``python -m pipelines.cli``."""
    words = shlex.split(text)
    assert words[1:3] == ["-m", "pipelines.cli"], text
    return [sys.executable, *words[1:]]


def _serve_ui(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """``packline ui`` started as printed (on a free port); its address once it is up."""
    proc = subprocess.Popen(
        [*argv, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO,
    )  # fmt: skip
    for line in proc.stdout:
        if line.startswith("MLflow UI: "):
            return proc, line.split(": ", 1)[1].strip().rstrip("/")
    raise AssertionError(f"packline ui exited {proc.wait()} before serving")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


def _masked(line: str) -> str:
    """A console line with what changes from run to run masked: numbers, and the widths
    rules and padding take from them."""
    line = re.sub(r"\d[\d,.]*", "#", line)
    line = re.sub(r"[─━]+", "─", line)
    return " ".join(line.split())


README = REPO / "README.md"
START, END = "<!-- run-output:start -->\n```text\n", "```\n<!-- run-output:end -->"


def _readme_excerpt(out: str, work: Path) -> list[str]:
    """The run's console as ``make run`` prints it: under runs/tiny_cpu, packline from the
    venv, no config named (no overrides); the packing on vs off table left to the tutorial."""
    text = out.replace(str(work), "runs/tiny_cpu").replace(" runs/tiny_cpu/pipeline.yaml", "")
    exe = os.path.abspath(sys.executable)  # as the run printed it (pipelines.outcome._shown)
    exe = os.path.relpath(exe, REPO) if exe.startswith(f"{REPO}/") else exe
    text = text.replace(f"{exe} -m pipelines.cli", ".venv/bin/packline")
    lines, skipping = [], False
    for line in text.splitlines():
        if line.startswith("packing on vs off"):
            skipping = True
            lines.append("(the packing on vs off table: tutorial/05-train-local.md)")
        elif line.startswith("pipeline finished"):
            skipping = False
        if not skipping:
            lines.append(line.rstrip())
    return lines


def _check_readme_excerpt(out: str, work: Path) -> None:
    """README's excerpt is this run's output, numbers aside; when it is not, rewrite it from
    this run and fail, so that the change is committed."""
    text = README.read_text()
    head, rest = text.split(START, 1)
    current, tail = rest.split(END, 1)
    fresh = _readme_excerpt(out, work)
    if [_masked(x) for x in current.splitlines()] != [_masked(x) for x in fresh]:
        README.write_text(head + START + "\n".join(fresh) + "\n" + END + tail)
        raise AssertionError(
            "README.md's run-output excerpt was not what packline run prints now: "
            "rewritten from this run; review and commit it"
        )


def _record(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "_COMPLETE.json").read_text())


def test_run_twice_skips_then_a_changed_sample_count_reruns(short_tmp: Path):
    work = short_tmp / "work"
    small = ["data.num_train=40", "data.num_val=6"]

    first = _run(work, *small)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout + first.stderr
    # A quiet console: a line per stage in order, the forecast, the packing on vs off table
    # and the summary once each; no progress bars, NeMo-Run banners or library prints (they
    # are in each stage's log); nothing wider than the console.
    ends = [out.index(f"✓ {stage} ") for stage in ("prepare", "connect", "validate", "train")]
    assert ends == sorted(ends)
    for table in ("packing forecast ·", "packing on vs off ·", "packline run · tiny_cpu"):
        assert out.count(table) == 1, table
    bar = "━" * 40 + " "  # rich's progress bar
    noise = ("it/s", bar, "Filling reading buffer", "Loading weights", "Experiment Status")
    for text in (*noise, "nemo experiment", "Task 0:"):
        assert text not in out, text
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= COLUMNS, widest
    assert "GFLOP packed vs" in out and "GFLOP │" in out  # SI units
    flat = " ".join(out.split())
    assert (
        "pipeline finished: prepare SUCCEEDED, connect SUCCEEDED, validate SUCCEEDED, "
        "train SUCCEEDED" in flat
    )
    validate_log = (work / "logs" / "validate" / "output.log").read_text()
    assert "validate: all" in validate_log and "rules hold" in validate_log
    assert "Filling reading buffer" in (work / "logs" / "train" / "output.log").read_text()
    report = json.loads((work / "validate" / "report.json").read_text())
    assert report["ok"] and report["errors"] == [] and report["warnings"] == []
    _check_readme_excerpt(out, work)

    # Every next step works as printed.
    steps = _next_steps(out)
    assert steps["adapter"].startswith(f"{work}/train/packed/adapter/")
    compare = subprocess.run(_command(steps["compare"]), capture_output=True, text=True, cwd=REPO)
    assert compare.returncode == 0 and "packing on vs off" in compare.stdout, compare.stderr
    chat = subprocess.run(_command(steps["chat"]), capture_output=True, text=True, cwd=REPO)
    assert chat.returncode == 0, chat.stderr
    assert re.search(r"(?m)^answer: .+\n^reference: .+", chat.stdout), chat.stdout
    export = subprocess.run(_command(steps["export"]), capture_output=True, text=True, cwd=REPO)
    assert export.returncode == 0, export.stderr
    assert (work / "export" / "merged" / "config.json").is_file()
    ui, base = _serve_ui(_command(steps["MLflow UI"]))
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=30) as page:
            assert page.status == 200
    finally:
        _stop(ui)

    prep1, conn1 = _record(work, "prepare"), _record(work, "connect")
    assert len(pd.read_parquet(work / "connect" / "lengths.parquet")) == 46

    second = _run(work, *small)
    assert second.returncode == 0, second.stderr[-3000:]
    out2 = second.stdout + second.stderr
    assert "prepare: up to date" in out2 and "connect: up to date" in out2
    assert "validate: up to date" in out2 and "train: up to date" in out2
    assert not re.search(r"✓ \w+ +[\d.]+ s", out2)  # nothing launched
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

    # The work dir travels: copied elsewhere and the original removed, the copy's adapter
    # loads, packline compare reads the copy's store and the MLflow UI serves its artifacts.
    copy = short_tmp / "moved" / "work"
    shutil.copytree(work, copy)
    shutil.rmtree(work)
    adapter = copy / "train" / "packed" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    tuned = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(TINY_BASE), adapter
    )
    with torch.no_grad():
        assert torch.isfinite(tuned(input_ids=torch.arange(1, 9)[None]).logits).all()
    moved = [f"work_dir={copy}", *small]
    compare = subprocess.run(
        [*PACKLINE, "compare", *moved, "--run", first_train.info.run_id],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert compare.returncode == 0, compare.stderr
    assert (copy / "compare" / "throughput.png").is_file()
    ui, base = _serve_ui([*PACKLINE, "ui", *moved])
    try:
        run_id = train_runs["train-packed"].info.run_id
        url = f"{base}/get-artifact?path=adapter/adapter_config.json&run_uuid={run_id}"
        with urllib.request.urlopen(url, timeout=30) as page:
            assert json.loads(page.read())["task_type"] == "CAUSAL_LM"
    finally:
        _stop(ui)


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
