"""`packline compare` and `packline ui` on the store of a real (quick) training run; the UI's
compare page rendered by headless Chromium (Debian's package: scripts/install-chromium.sh),
and the tutorial's picture of its chart view taken from that run."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image, ImageStat
from PIL.PngImagePlugin import PngInfo

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
)
DUMP_FLAGS = (
    "--window-size=1400,2400",
    # Let the single-page app fetch the runs and render before the DOM is dumped.
    "--virtual-time-budget=20000",
)

# The tutorial's picture (tutorial/06-compare.md): the experiment page's chart view of this
# module's run, the three figures of packing on vs off as bars of each run's latest value.
PICTURE = REPO / "tutorial" / "img" / "compare-page.png"
PICTURE_METRICS = (M.THROUGHPUT_REAL_TOKENS_PER_S, M.PACK_FILL, M.EVAL_LOSS)
PICTURE_SIZE = (1400, 700)
# What the picture is made from, hashed (with the MLflow version, whose UI draws it) into
# its PICTURE_KEY text chunk: the run's training and the page's state (this file), the UI
# server, the metric names shown, the config trained and the base it trains (its manifest
# holds the weights' sha256).
PICTURE_SOURCES = (
    "tests/e2e/test_compare_ui.py",
    "pipelines/ui.py",
    "packline/metrics.py",
    "configs/tiny_cpu.yaml",
    "models/tiny-base/manifest.json",
)
PICTURE_KEY = "packline-sources-sha256"
# As in packline compare's plots.
RUN_COLORS = {"train-packed": "#1f77b4", "train-unpacked": "#ff7f0e"}


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
        # chance is NaN when no question kind asked has a chance to tell (2 questions here,
        # each of a kind with no closed answer set): NaN agrees with NaN
        chance = pytest.approx(result["eval_accuracy_chance"], nan_ok=True)
        assert from_store.eval_accuracy_chance == chance
        store, files = (asdict(replace(s, eval_by_kind=None)) for s in (from_store, from_files))
        assert store.keys() == files.keys()
        for key, value in store.items():
            nan = isinstance(value, float) and math.isnan(value)
            assert (nan and math.isnan(files[key])) or value == files[key], key


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


def _browse(chromium: str, url: str, profile: Path):
    """Headless Chromium dumping the DOM of ``url`` in its own process group."""
    return subprocess.Popen(
        [chromium, *CHROMIUM_FLAGS, *DUMP_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
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


class _DevTools:
    """Headless Chromium driven over the DevTools protocol on a pipe: it reads commands on
    its fd 3 and writes replies on its fd 4 (``--remote-debugging-pipe``), each message JSON
    ended by a NUL byte; no port, no websocket client. ``call`` talks to the one page."""

    def __init__(self, chromium: str, profile: Path, timeout: float = 60.0):
        cmd_r, self._cmd_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        self._timeout = timeout
        self._buffer = b""
        self._last_id = 0
        self._session = None
        # bash puts the pipe ends on fds 3 and 4, then execs chromium (same pid and group).
        self.proc = subprocess.Popen(
            ["bash", "-c", 'exec "${@:3}" 3<&"$1" 4>&"$2"', "bash", str(cmd_r), str(reply_w)]
            + [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
            + ["--remote-debugging-pipe", "about:blank"],
            pass_fds=(cmd_r, reply_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(cmd_r)
        os.close(reply_w)

    def attach(self) -> None:
        """Later calls go to the page (the one Chromium opened)."""
        pages = [t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        target = self.call("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)
        self._session = target["sessionId"]

    def call(self, method: str, **params) -> dict:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._cmd_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self._timeout
        while True:  # events (no id) and late replies are skipped
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._reply_r], [], [], left)[0]:
                    raise AssertionError(f"chromium did not answer {method} in {self._timeout} s")
                chunk = os.read(self._reply_r, 1 << 20)
                if not chunk:
                    raise AssertionError(f"chromium closed its DevTools pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._last_id:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except AssertionError:
            pass  # the pipe may close before the reply
        try:
            self.proc.wait(timeout=30)
        finally:
            os.close(self._cmd_w)
            os.close(self._reply_r)


def _chart_view_storage(client: MlflowClient, experiment_id: str, runs: dict) -> dict[str, str]:
    """The UI's localStorage for the experiment page's chart view of the training runs: one
    section of bar charts of PICTURE_METRICS (every other metric's chart deleted, so none is
    added), the runs named train-* (the train stage's run expanded to show its two), their
    colours, and the assistant panel closed (not opened on a first visit)."""
    logged = set().union(*(r.data.metrics for r in client.search_runs([experiment_id])))
    charts = [
        {
            "uuid": f"packline-{key}",
            "type": "BAR",
            "metricSectionId": "packline",
            "metricKey": key,
            "displayName": key,
            "runsCountToCompare": 10,
            "isGenerated": False,
            "deleted": key not in PICTURE_METRICS,
        }
        for key in [*PICTURE_METRICS, *sorted(logged - set(PICTURE_METRICS))]
    ]
    section = {"uuid": "packline", "name": "packing on vs off", "display": True, "deleted": False}
    page_state = {
        "searchFilter": "attributes.run_name LIKE 'train-%'",
        "runsExpanded": {runs["train"].info.run_id: True},
        "runListHidden": True,  # wider charts; each has its legend
        "compareRunCharts": charts,
        "compareRunSections": [section],
    }
    colors = {runs[name].info.run_id: color for name, color in RUN_COLORS.items()}
    # MLflow 3.x keys: ExperimentPage's state is stored per JSON list of experiment ids.
    key = json.dumps([experiment_id])
    return {
        f"MLflowLocalStorage-1.1-ExperimentPage-{key}-ReactComponentState": json.dumps(page_state),
        "experimentRunColors": json.dumps(colors),
        "mlflow.assistant.panelOpen_v1": "false",
        "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
    }


# The text on each chart's bars, chart by chart (Plotly draws it in SVG <text class="bartext">).
BAR_LABELS = """JSON.stringify([...document.querySelectorAll(".js-plotly-plot")].map(
    (plot) => [...plot.querySelectorAll(".bartext")].map((label) => label.textContent)))"""


def _shoot_chart_view(
    browser: _DevTools,
    base: str,
    experiment_id: str,
    storage: dict[str, str],
    bars: list[list[str]],
    names: list[str],
) -> tuple[bytes, str]:
    """The chart view's PNG and visible text, once its charts' bar labels are ``bars`` (per
    chart, in any order) and every string of ``names`` shows."""
    # Before the app's scripts: its stored state; the assistant's button hidden by CSS.
    script = f"""
        if (location.origin === {json.dumps(base)}) {{
            for (const [k, v] of Object.entries({json.dumps(storage)})) localStorage.setItem(k, v);
        }}
        document.addEventListener("DOMContentLoaded", () => {{
            const style = document.createElement("style");
            style.textContent = "[data-assistant-ui] {{ display: none !important; }}";
            document.head.append(style);
        }});
    """
    width, height = PICTURE_SIZE
    browser.attach()
    browser.call("Page.enable")
    browser.call("Page.addScriptToEvaluateOnNewDocument", source=script)
    browser.call(
        "Emulation.setDeviceMetricsOverride",
        width=width,
        height=height,
        deviceScaleFactor=1,
        mobile=False,
    )
    page = f"{base}/#/experiments/{experiment_id}/runs"
    browser.call("Page.navigate", url=f"{page}?workflowType=machine_learning&compareRunsMode=CHART")
    want = [sorted(chart) for chart in bars]
    deadline = time.monotonic() + 60
    text, shown = "", []
    while shown != want or not all(name in text for name in names):
        assert time.monotonic() < deadline, (shown, want, text)
        time.sleep(0.5)
        text = browser.evaluate("document.body.innerText") or ""
        shown = [sorted(chart) for chart in json.loads(browser.evaluate(BAR_LABELS) or "[]")]
    time.sleep(1)  # the bars' last frame
    png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    return png, text


def _sources_digest() -> str:
    """sha256 of the MLflow version and PICTURE_SOURCES, each named."""
    digest = hashlib.sha256(f"mlflow {mlflow.__version__}\0".encode())
    for path in PICTURE_SOURCES:
        digest.update(path.encode() + b"\0" + (REPO / path).read_bytes() + b"\0")
    return digest.hexdigest()


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

        browsers.append(_browse(chromium, url, tmp_path / "profile"))
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

        # The tutorial's picture: the chart view of PICTURE_METRICS, one bar per run.
        devtools = _DevTools(chromium, tmp_path / "profile-charts")
        browsers.append(devtools.proc)
        storage = _chart_view_storage(client, on.info.experiment_id, runs)
        # Each chart's two bars are labelled with the runs' latest values, 2 decimals.
        bars = [[f"{run.data.metrics[key]:.2f}" for run in (on, off)] for key in PICTURE_METRICS]
        names = [*PICTURE_METRICS, *RUN_COLORS, "packing on vs off"]
        try:
            png, text = _shoot_chart_view(
                devtools, base.rstrip("/"), on.info.experiment_id, storage, bars, names
            )
        finally:
            devtools.close()
        assert "MLflow Assistant" not in text
        # Only the two training runs' bars: no other run's name in the charts' legends.
        assert sorted(set(re.findall(r"\btrain-\w+", text))) == sorted(RUN_COLORS)
        picture = Image.open(io.BytesIO(png))
        assert picture.format == "PNG" and picture.size == PICTURE_SIZE
        assert ImageStat.Stat(picture.convert("L")).stddev[0] > 20  # not a blank page
        colors = picture.convert("RGB").getcolors(PICTURE_SIZE[0] * PICTURE_SIZE[1])
        drawn = {f"#{r:02x}{g:02x}{b:02x}": n for n, (r, g, b) in colors}
        for run, color in RUN_COLORS.items():  # each run's three bars, in its colour
            assert drawn.get(color, 0) > 3000, (run, color, drawn.get(color, 0))
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
    assert len(browsers) == 4
    for browser in browsers:
        assert _group_alive(browser.pid) == []
    assert server_pgid is not None and _group_alive(server_pgid) == []  # no orphaned server

    # The committed picture is rewritten (and the test fails) when its sources changed.
    digest = _sources_digest()
    committed = None
    if PICTURE.exists():
        with Image.open(PICTURE) as img:
            committed = img.text.get(PICTURE_KEY)
    if committed != digest:
        info = PngInfo()
        info.add_text(PICTURE_KEY, digest)
        picture.save(PICTURE, pnginfo=info, optimize=True)
        pytest.fail(f"regenerated {PICTURE.relative_to(REPO)} from its changed sources; commit it")
