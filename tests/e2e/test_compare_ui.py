"""`packline compare` and `packline ui` on the store of a real (quick) training run; the UI's
compare page rendered by headless Chromium (Debian's package: scripts/install-chromium.sh)."""

from __future__ import annotations

import html
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from packline import metrics as M
from packline.report.mlflow_store import READS, read_training_run
from packline.report.plots import PLOTS
from packline.report.summary import EVAL_INPUTS, STEP_INPUTS, summarize_run
from packline.tracking import Tracker
from packline.train.records import read_records
from pipelines.experiment import pipeline_stages
from schemas.config import PipelineConfig
from stages.runner import run_stage
from tests.conftest import make_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PACKLINE = [sys.executable, "-m", "pipelines.cli"]
# Just enough training for both modes to log every metric (as tests/e2e/test_pipeline_run.py).
QUICK = (
    "data.num_train=40",
    "data.num_val=6",
    "train.max_steps=2",
    "train.save_every=2",
    "train.global_batch_size=2",
    "train.eval_samples=2",
)
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # root in CI
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # no network but loopback: no update/sync lookups
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,2400",
    # Let the single-page app fetch the runs and render before the DOM is dumped.
    "--virtual-time-budget=20000",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> PipelineConfig:
    """The stages of `packline run`, in this process, under a pipeline parent run."""
    cfg = make_config(tmp_path_factory.mktemp("ui") / "work", *QUICK)
    parent = Tracker.start(cfg, "pipeline-quick", tags={"packline.kind": "pipeline"})
    for stage in pipeline_stages():
        run_stage(cfg, stage, parent_run_id=parent.run_id)
    parent.end()
    return cfg


def _training_runs(cfg: PipelineConfig) -> tuple[MlflowClient, dict]:
    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.work_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name(cfg.name)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    return client, runs


def test_compare_on_a_quick_real_run_agrees_with_the_store(trained):
    result = subprocess.run(
        [*PACKLINE, "compare", f"work_dir={trained.work_path}"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "160"},
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client, runs = _training_runs(trained)
    on, off = runs["train-packed"], runs["train-unpacked"]
    assert f"train-packed {on.info.run_id[:8]}" in result.stdout
    assert f"train-unpacked {off.info.run_id[:8]}" in result.stdout

    def rate(run) -> float:
        tokens = client.get_metric_history(run.info.run_id, M.TRAIN_TOKENS_REAL)
        seconds = client.get_metric_history(run.info.run_id, M.TRAIN_STEP_SECONDS)
        return sum(m.value for m in tokens) / sum(m.value for m in seconds)

    saved = json.loads((trained.work_path / "compare" / "compare.json").read_text())
    assert saved["speedup_real_tokens_per_s"] == pytest.approx(rate(on) / rate(off), rel=1e-12)
    # The train stage computed the same figure from its metrics.jsonl.
    stage = runs["train"].data.metrics[M.COMPARE_SPEEDUP_REAL_TOKENS_PER_S]
    assert saved["speedup_real_tokens_per_s"] == pytest.approx(stage, rel=1e-9)
    assert f"{saved['speedup_real_tokens_per_s']:.2f}x" in result.stdout
    packed, unpacked = saved["packed"], saved["unpacked"]
    assert packed["real_tokens"] == unpacked["real_tokens"] > 0  # same conversations
    assert packed["fill"] > unpacked["fill"] and packed["padding_fraction"] < 0.01
    assert unpacked["conversations_per_row"] == 1.0 < packed["conversations_per_row"]
    assert saved["pipeline_run_id"] == runs["pipeline-quick"].info.run_id
    for name in PLOTS:
        with Image.open(trained.work_path / "compare" / name) as img:
            assert img.format == "PNG" and img.size == (700, 450)


def _records(cfg: PipelineConfig, run: str) -> tuple[list[dict], list[dict]]:
    run_dir = cfg.work_path / "train" / run
    return read_records(run_dir / "metrics.jsonl"), read_records(run_dir / "eval.jsonl")


def test_every_metric_compare_reads_is_one_the_train_stage_writes(trained):
    """Both ends name metrics through packline.metrics: what compare and the summary read is
    what the train stage logged, to MLflow and to its records, and everything it logged is
    a name of packline.metrics (a renamed metric fails here, not as a silent zero)."""
    client, runs = _training_runs(trained)
    for run in ("packed", "unpacked"):
        logged = set(runs[f"train-{run}"].data.metrics)
        assert set(READS) <= logged, sorted(set(READS) - logged)
        assert set(M.STEP_METRICS) | set(M.EVAL_METRICS) <= logged
        assert [n for n in logged if not M.defines(n)] == []
        steps, evals = _records(trained, run)
        assert steps and evals
        for record in steps:
            assert set(STEP_INPUTS) | set(M.STEP_METRICS) <= set(record)
            assert [n for n in record if "/" in n and not M.defines(n)] == []
        for record in evals:
            assert set(EVAL_INPUTS) | {M.EVAL_BY_KIND} <= set(record)
        assert set(runs["train"].data.metrics) >= {M.compare(run, f) for f in M.COMPARE_FIGURES} | {
            M.COMPARE_SPEEDUP_REAL_TOKENS_PER_S
        }


def test_the_summary_read_from_mlflow_is_the_one_the_stage_wrote_from_its_records(trained):
    """The same RunSummary whichever the source, the stage's records or the store's
    histories (wall time and run id aside, which only the store knows)."""
    client, runs = _training_runs(trained)
    for run in ("packed", "unpacked"):
        from_store, _ = read_training_run(client, runs[f"train-{run}"])
        assert from_store.run_id == runs[f"train-{run}"].info.run_id
        assert from_store.wall_seconds > from_store.train_seconds > 0
        result = json.loads((trained.work_path / "train" / run / "result.json").read_text())
        from_files = summarize_run(
            *_records(trained, run),
            run=run,
            seq_length=trained.packing.seq_length,
            precision=from_store.precision,
            ranks=from_store.ranks,
            chance=result["eval_accuracy_chance"],
            chance_by_kind={k: v["chance"] for k, v in result["eval_by_kind"].items()},
            wall_seconds=from_store.wall_seconds,
            run_id=from_store.run_id,
        )
        assert from_store.eval_accuracy_chance == pytest.approx(result["eval_accuracy_chance"])
        assert replace(from_store, eval_by_kind=None) == replace(from_files, eval_by_kind=None)


def test_compare_reads_the_per_kind_accuracy_and_the_run_facts_the_stage_logs(trained):
    """What only result.json held before: accuracy per question kind (with its chance), the
    resolved precision and the ranks, read back from the store."""
    client, runs = _training_runs(trained)
    for run in ("packed", "unpacked"):
        from_store, _ = read_training_run(client, runs[f"train-{run}"])
        result = json.loads((trained.work_path / "train" / run / "result.json").read_text())
        assert from_store.eval_by_kind == result["eval_by_kind"]
        assert (from_store.precision, from_store.ranks) == (result["precision"], result["ranks"])


def _chromium() -> str:
    """Chromium on PATH, installed first by the project's script (apt, Debian's package)
    when it is missing; skipped, saying why, only where it cannot be installed (no root,
    no apt, Ubuntu's snap stub) — and never under CI."""
    path = os.environ.get("PACKLINE_CHROMIUM") or shutil.which("chromium")
    if path:
        return path
    script = REPO / "scripts" / "install-chromium.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
    path = shutil.which("chromium")
    if done.returncode == 0 and path:
        return path
    message = f"no chromium, and {script.name} could not install it: {done.stderr[-500:]}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, prefix: str, seen: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise AssertionError(f"no {prefix!r} line from packline ui:\n" + "\n".join(seen))


def _group_alive(pgid: int) -> list[int]:
    """PIDs still in process group ``pgid`` (zombies excluded)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _killpg(pgid: int | None) -> None:
    if pgid:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _browse(chromium: str, url: str, profile: Path, *, screenshot: Path | None = None):
    """Headless Chromium dumping the DOM of ``url`` (and a screenshot) in its own group."""
    shot = [f"--screenshot={screenshot}"] if screenshot is not None else []
    return subprocess.Popen(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *shot, "--dump-dom", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _dom(browser: subprocess.Popen) -> str:
    dom, _ = browser.communicate(timeout=120)
    assert browser.returncode == 0
    return dom.decode(errors="replace")


def _visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def _shown(value: float, numbers: list[float]) -> bool:
    """The UI rounds for display (608.554 → 608.6, 0.0996 → 0.1)."""
    return any(abs(n - value) <= max(5e-4, 5e-3 * abs(value)) for n in numbers)


def test_ui_compare_page_shows_both_runs_and_their_metrics_in_headless_chromium(trained, tmp_path):
    chromium = _chromium()
    client, runs = _training_runs(trained)
    on, off = runs["train-packed"], runs["train-unpacked"]
    ui = subprocess.Popen(
        [*PACKLINE, "ui", f"work_dir={trained.work_path}", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    server_pgid = None
    browsers: list[subprocess.Popen] = []
    seen: list[str] = []
    try:
        lines = _lines(ui)
        url = _wait_for(lines, "packing on vs off: ", seen, timeout=180)
        assert url.startswith("http://127.0.0.1:") and "/#/compare-runs?runs=" in url
        assert on.info.run_id in url and off.info.run_id in url
        server_pgid = int(_wait_for(lines, "server pid ", seen, timeout=10).split(";")[0])

        shot = tmp_path / "compare.png"
        browsers.append(_browse(chromium, url, tmp_path / "profile", screenshot=shot))
        text = _visible_text(_dom(browsers[-1]))
        assert "Comparing 2 Runs" in text, text[:2000]
        for run in (on, off):
            assert run.info.run_name in text and run.info.run_id in text
        # The compare page's metric table renders only the rows near its viewport (about
        # 16, in key order: data/*, then eval/*), so it is checked for keys that sort
        # first, a question kind's accuracy among them ...
        kind = min(k for k in on.data.metrics if k.startswith("eval/by_kind/"))
        for key in (M.DATA_SEEN, M.EVAL_ACCURACY, kind, M.EVAL_LOSS):
            assert key in text, key
        with Image.open(shot) as img:
            assert img.format == "PNG" and img.size == (1400, 2400)
        # ... and each run's own page, which lists every metric, for the latest values.
        base = url.split("#", 1)[0]
        for run in (on, off):
            page = f"{base}#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
            browsers.append(_browse(chromium, page, tmp_path / f"profile-{run.info.run_name}"))
            text = _visible_text(_dom(browsers[-1]))
            plain = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 1,234.5 → 1234.5
            numbers = [float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", plain)]
            for key in (M.THROUGHPUT_REAL_TOKENS_PER_S, M.PACK_FILL, M.EVAL_LOSS, M.EVAL_ACCURACY):
                assert key in text, (run.info.run_name, key)
                assert _shown(run.data.metrics[key], numbers), (key, run.data.metrics[key])
    finally:
        for browser in browsers:
            if browser.poll() is None:
                _killpg(browser.pid)
                browser.wait()
        if ui.poll() is None:
            ui.send_signal(signal.SIGTERM)  # as a user's Ctrl-C / kill would
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _killpg(ui.pid)
            _killpg(server_pgid)
            ui.wait()
    assert ui.returncode == 0, "\n".join(seen)
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    assert "mlflow server stopped" in seen
    assert len(browsers) == 3
    for browser in browsers:
        assert _group_alive(browser.pid) == []
    assert server_pgid is not None and _group_alive(server_pgid) == []  # no orphaned server
