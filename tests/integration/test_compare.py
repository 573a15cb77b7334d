"""`packline compare` on a real sqlite MLflow store, filled through packline's own tracker
with known metrics: the figures, the speedup and the plots come back from the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from packline import metrics as M
from packline.counters import layout_metrics, row_fills
from packline.report.mlflow_store import compare_url, find_training_pair, open_store
from packline.report.plots import PLOTS
from packline.report.summary import RunSummary
from packline.tracking import Tracker
from pipelines.compare import compare_runs
from schemas.errors import UserError
from tests.conftest import make_config

REPO = Path(__file__).resolve().parents[2]
SEQ = 2048
# Three steps; both modes train on the same conversations (same real tokens per step).
REAL = [4000, 4100, 3900]
CONVS = [20, 18, 22]
SECONDS = {"packed": [2.0, 2.5, 1.5], "unpacked": [3.0, 3.5, 2.5]}
CPU_SECONDS = {"packed": [3.0, 4.0, 3.0], "unpacked": [6.0, 7.0, 5.0]}  # over both threads
PADDED = {"packed": [0, 0, 0], "unpacked": [3000, 3100, 2800]}
DATA_SECONDS = [0.5, 0.4, 0.6]  # of the step seconds, the same work packed or not
VISION_SECONDS = [0.3, 0.3, 0.3]
LOSS = [8.0, 7.5, 7.0]


def _row_tokens(packed: bool, step: int) -> list[int]:
    """Per laid-out row: two packed rows, or one row per conversation."""
    total, n = REAL[step], (2 if packed else CONVS[step])
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _log_training_run(cfg, stage_run_id: str, packed: bool, scale: float = 1.0) -> str:
    mode = "packed" if packed else "unpacked"
    run = Tracker.start(
        cfg,
        f"train-{mode}",
        parent_run_id=stage_run_id,
        tags={M.TAG_STAGE: "train", M.TAG_PACKING: str(packed).lower()},
    )
    run.log_metrics(
        {M.EVAL_LOSS: 8.4, M.EVAL_TOKEN_ACCURACY: 0.1, M.EVAL_ACCURACY: 0.0, M.EVAL_QUESTIONS: 4},
        step=0,
    )
    cum, laid_out = 0, 0
    for i in range(3):
        seconds = SECONDS[mode][i] * scale
        cum += REAL[i]
        rows = _row_tokens(packed, i)
        laid_out += len(rows)
        run.log_metrics(
            {
                M.TRAIN_LOSS: LOSS[i],
                M.TRAIN_TOKENS_REAL: REAL[i],
                M.cumulative(M.TRAIN_TOKENS_REAL): cum,
                M.TRAIN_PADDED_TOKENS: PADDED[mode][i],
                M.TRAIN_CONVERSATIONS: CONVS[i],
                M.TRAIN_STEP_SECONDS: seconds,
                M.TRAIN_CPU_SECONDS: CPU_SECONDS[mode][i] * scale,
                M.TRAIN_DATA_SECONDS: DATA_SECONDS[i],
                M.TRAIN_VISION_SECONDS: VISION_SECONDS[i],
                M.TRAIN_FLOPS_USEFUL: 1e12,
                M.TRAIN_FLOPS_EXECUTED: 1e12 if packed else 1.6e12,
                M.THROUGHPUT_REAL_TOKENS_PER_S: REAL[i] / seconds,
                **layout_metrics(
                    rows, conversations=CONVS[i], padded_tokens=PADDED[mode][i], seq_length=SEQ
                ),
            },
            step=i + 1,
        )
        run.log_series(M.PACK_ROW_FILL, row_fills(rows, SEQ), first_step=laid_out - len(rows) + 1)
    run.log_metrics(
        {M.EVAL_LOSS: 7.1, M.EVAL_TOKEN_ACCURACY: 0.3, M.EVAL_ACCURACY: 0.25, M.EVAL_QUESTIONS: 4},
        step=3,
    )
    run.end()
    return run.run_id


def _log_pipeline(cfg, *, train: bool, scale: float = 1.0) -> dict[str, str]:
    """A pipeline parent run → train stage run → packed and unpacked runs (or, as a rerun
    with an up-to-date train stage, a skipped stage run without children)."""
    time.sleep(0.01)  # distinct start times
    parent = Tracker.start(cfg, "pipeline-test", tags={"packline.kind": "pipeline"})
    stage = Tracker.start(
        cfg,
        "train",
        parent_run_id=parent.run_id,
        tags={M.TAG_STAGE: "train", "packline.skipped": str(not train).lower()},
    )
    ids = {"pipeline": parent.run_id, "stage": stage.run_id}
    if train:
        ids["packed"] = _log_training_run(cfg, stage.run_id, True, scale)
        ids["unpacked"] = _log_training_run(cfg, stage.run_id, False, scale)
    stage.end()
    parent.end()
    return ids


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("compare") / "work", f"packing.seq_length={SEQ}")
    older = _log_pipeline(cfg, train=True, scale=2.0)
    newest = _log_pipeline(cfg, train=True)
    _log_pipeline(cfg, train=False)  # a later rerun that skipped the train stage
    return cfg, older, newest


def test_compare_reads_the_newest_pair_and_its_speedup_from_the_store(store):
    cfg, older, newest = store
    result = compare_runs(cfg)

    # The newest pair, under the pipeline that trained it (the later rerun skipped train).
    assert result.packed.run_id == newest["packed"]
    assert result.unpacked.run_id == newest["unpacked"]
    assert result.pipeline_run_id == newest["pipeline"]
    assert result.stage_run_id == newest["stage"]

    # Against the logged values: Σ real tokens / Σ step seconds, per mode.
    on, off = result.packed, result.unpacked
    assert on.real_tokens == off.real_tokens == sum(REAL)
    assert on.real_tokens_per_s == pytest.approx(12000 / 6.0)
    assert off.real_tokens_per_s == pytest.approx(12000 / 9.0)
    assert result.speedup_real_tokens_per_s == pytest.approx(1.5)
    # ... and against the store itself, read here independently.
    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.work_path / 'mlflow.db'}")

    def total(run_id: str, key: str) -> float:
        return sum(m.value for m in client.get_metric_history(run_id, key))

    rate = {
        mode: total(newest[mode], M.TRAIN_TOKENS_REAL) / total(newest[mode], M.TRAIN_STEP_SECONDS)
        for mode in ("packed", "unpacked")
    }
    assert result.speedup_real_tokens_per_s == pytest.approx(rate["packed"] / rate["unpacked"])

    assert on.padding_fraction == 0.0
    assert off.padding_fraction == pytest.approx(8900 / (12000 + 8900))
    assert on.fill == pytest.approx(12000 / (6 * SEQ))
    assert off.fill == pytest.approx(12000 / (60 * SEQ))
    assert on.conversations_per_row == pytest.approx(60 / 6)
    assert off.conversations_per_row == pytest.approx(1.0)
    assert on.final_train_loss == off.final_train_loss == 7.0
    assert (on.eval_loss_start, on.eval_loss) == (8.4, 7.1)
    assert (on.eval_token_accuracy_start, on.eval_token_accuracy) == (0.1, 0.3)
    assert (on.eval_accuracy_start, on.eval_accuracy) == (0.0, 0.25)
    assert on.tflops_useful == pytest.approx(3.0) and off.tflops_executed == pytest.approx(4.8)
    assert on.steps == 3 and on.first_step == 1
    assert on.eval_questions == 4 and on.eval_by_kind is None  # no per-kind metrics logged
    # Where the time went, and the pair's ratios (the same figures bench train reports).
    assert (on.train_seconds, off.train_seconds) == pytest.approx((6.0, 9.0))
    # per CPU-second beside wall-clock, and per window (here a step each)
    assert (on.cpu_seconds, off.cpu_seconds) == pytest.approx((10.0, 18.0))
    assert result.pair.speedup_per_cpu_s == pytest.approx((12000 / 10.0) / (12000 / 18.0))
    assert on.window_tokens_per_s == pytest.approx([4000 / 2.0, 4100 / 2.5, 3900 / 1.5])
    assert result.pair.window_speedups() == pytest.approx([1.5, 3.5 / 2.5, 2.5 / 1.5])
    assert on.data_seconds == off.data_seconds == pytest.approx(1.5)
    assert on.other_seconds == pytest.approx(6.0 - 1.5 - 0.9)
    pair = result.pair
    assert pair.speedup_without_data == pytest.approx((9.0 - 1.5) / (6.0 - 1.5))
    assert pair.speedup_without_data_and_vision == pytest.approx((9.0 - 2.4) / (6.0 - 2.4))
    assert pair.flops_executed_ratio == pytest.approx(1.6)
    assert pair.target_eval_loss == 7.1
    assert pair.seconds_to_eval_loss == pytest.approx({"packed": 6.0, "unpacked": 9.0})

    # Plots: valid PNGs of the set size, saved under the work dir and on the parent run.
    out = cfg.work_path / "compare"
    for name in PLOTS:
        with Image.open(out / name) as img:
            img.verify()
        with Image.open(out / name) as img:
            assert img.format == "PNG" and img.size == (700, 450)
    saved = json.loads((out / "compare.json").read_text())
    assert saved["speedup_real_tokens_per_s"] == pytest.approx(1.5)
    assert saved["flops_executed_ratio"] == pytest.approx(1.6)
    assert RunSummary.from_dict(saved["packed"]) == on  # the same type, read back
    assert RunSummary.from_dict(saved["unpacked"]) == off
    logged = {a.path for a in client.list_artifacts(newest["pipeline"], "compare")}
    assert {f"compare/{p}" for p in PLOTS} | {"compare/compare.json"} <= logged

    # --run picks an older pair.
    old = compare_runs(cfg, run_id=older["pipeline"])
    assert old.packed.run_id == older["packed"]
    assert old.speedup_real_tokens_per_s == pytest.approx(1.5)
    assert old.packed.real_tokens_per_s == pytest.approx(12000 / 12.0)


def test_compare_cli_prints_both_runs_and_the_speedup(store):
    cfg, _, newest = store
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "compare", f"work_dir={cfg.work_path}"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "160"},
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"train-packed {newest['packed'][:8]}" in out
    assert f"train-unpacked {newest['unpacked'][:8]}" in out
    assert "2,000" in out and "1,333" in out  # real tokens/s on and off
    assert "1.50x" in out
    assert "pack_fill_histogram.png" in out


def test_compare_without_the_runs_is_an_input_error(tmp_path: Path):
    cfg = make_config(tmp_path / "work")
    with pytest.raises(UserError, match="no MLflow store"):
        open_store(cfg)
    assert not (cfg.work_path / "mlflow.db").exists()  # no empty store left behind

    parent = Tracker.start(cfg, "pipeline-test", tags={"packline.kind": "pipeline"})
    stage = Tracker.start(cfg, "train", parent_run_id=parent.run_id, tags={M.TAG_STAGE: "train"})
    _log_training_run(cfg, stage.run_id, packed=True)  # packing off never ran
    client = open_store(cfg)
    with pytest.raises(UserError, match="no MLflow experiment named 'other'"):
        find_training_pair(client, "other")
    with pytest.raises(UserError, match="no finished train-packed and train-unpacked"):
        find_training_pair(client, cfg.name)

    # The CLI: exit 2, the problem listed, no traceback.
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "compare", f"work_dir={tmp_path / 'none'}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert "nothing to compare" in result.stderr and "no MLflow store" in result.stderr
    assert "Traceback" not in result.stderr


def test_compare_url_is_the_mlflow_compare_runs_route():
    url = compare_url("http://127.0.0.1:5000/", "3", ["a1", "b2"])
    assert url == (
        "http://127.0.0.1:5000/#/compare-runs?runs=%5B%22a1%22%2C%22b2%22%5D&experiments=%5B%223%22%5D"
    )


def _log_cluster_run(work: Path, packer: list[str], forecast: dict, bridge: dict) -> str:
    """A megatron train stage run as the runner logs it: the config as params, the packs'
    figures of connect's forecast (``packing_metrics``, what ``train_megatron`` returns) and
    Bridge's nested metrics."""
    from packline.packing.forecast import packing_metrics

    cfg = make_config(work, "train.backend=megatron", *packer)
    time.sleep(0.01)  # distinct start times
    stage = Tracker.start(cfg, "train", tags={M.TAG_STAGE: "train"})
    stage.log_metrics({**packing_metrics({"flops": forecast}), **bridge})
    stage.end()
    return stage.run_id


def _forecast(real: float, rows: float, straggler: float) -> dict:
    return {
        "tokens_real": real,
        "tokens_capacity_packed": rows * 4096,
        "padding_share_packed": 1 - real / (rows * 4096),
        "straggler_ratio": straggler,
        "rows_packed": rows,
    }


def test_compare_of_cluster_runs_sets_bridges_packer_against_packlines(tmp_path: Path):
    work = tmp_path / "work"
    bridge_packer = ["packing.packer=bridge", "packing.algorithm=ffd", "packing.max_carry_rounds=0"]
    _log_cluster_run(work, [], _forecast(3.0e6, 900, 1.03), {"megatron/lm loss": 2.5})
    bridge = _log_cluster_run(
        work, bridge_packer, _forecast(3.0e6, 840, 1.145), {"megatron/lm loss": 2.0}
    )
    ours = _log_cluster_run(work, [], _forecast(3.0e6, 735, 1.02), {"megatron/lm loss": 1.9})
    cfg = make_config(work, "train.backend=megatron")
    runs = compare_runs(cfg)
    assert [r.run_id for r in runs] == [bridge, ours]  # the newest of each packer setting
    assert [r.settings["packing.packer"] for r in runs] == ["bridge", "packline"]
    assert runs[1].metrics["packing/forecast_fill"] == pytest.approx(3.0e6 / (735 * 4096))
    saved = json.loads((work / "compare" / "cluster.json").read_text())
    assert [r["run_id"] for r in saved] == [bridge, ours]

    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "compare", f"work_dir={work}",
         "train.backend=megatron"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"}, cwd=REPO,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in result.stdout.splitlines()
        if line.count("│") >= 3
    }
    assert rows["fill (real / rows × seq_length)"] == [f"{3.0e6 / (840 * 4096):.3f}",
                                                       f"{3.0e6 / (735 * 4096):.3f}"]  # fmt: skip
    assert rows["straggler ratio (slowest DP rank / mean)"] == ["1.145", "1.020"]
    assert rows["packing.max_carry_rounds"] == ["0", "4"]
    assert rows["megatron/lm loss"] == ["2", "1.9"]

    with pytest.raises(UserError, match="no finished train.backend=megatron train runs under"):
        compare_runs(cfg, run_id="nope")
