"""``packline bench loader`` as a user runs it (a subprocess, its own small config), and
``bench packing`` on the same prepared set: both measure through the real Energon loader;
a run of the loader ends its worker processes before it returns."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from packline.bench.loader import RSS_RUNS, THROUGHPUT_BUFFER, run_loader
from packline.bench.processes import child_pids
from pipelines import bench
from tests.integration.bench_cli import run_bench

SMALL_YAML = """\
name: bench_loader_small
data: {num_train: 40, num_val: 4}
prepare: {num_workers: 1}
"""


@pytest.fixture(scope="module")
def loader_result(tmp_path_factory) -> tuple[dict, Path, Path]:
    return run_bench("loader", SMALL_YAML, tmp_path_factory.mktemp("bench_loader"))


def test_bench_loader_cli_measures_memory_throughput_and_fill(loader_result):
    result, _, _ = loader_result
    assert set(result["worker_rss_mb"]) == {f"{m}_ffd@{b}" for m, b in RSS_RUNS}
    assert all(v > 0 for v in result["worker_rss_mb"].values())
    speed = result["samples_per_s"]
    assert set(speed) == {"encode_only", f"lazy_ffd@{THROUGHPUT_BUFFER}"}
    assert all(v > 0 for v in speed.values())
    assert result["packing_overhead"] == pytest.approx(
        1 - speed["lazy_ffd@256"] / speed["encode_only"]
    )
    assert 0 < result["fill_measured"] <= 1
    assert set(result["targets"]) == {
        "worker_rss_mb.lazy_ffd@256",
        "worker_rss_mb.lazy_vs_eager@256",
        "packing_overhead",
    }


def test_bench_packing_reports_the_loader_figures_beside_the_fills(loader_result, capsys):
    _, config, work = loader_result  # the set is prepared: packing reuses it
    result = bench.bench_packing(
        as_json=True,
        config=config,
        work_dir=work,
        num_vlm_samples=500,
        num_select_lengths=500,
        throughput_rounds=1,
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(result))
    fill = result["default"]["fill"]
    assert 0 < fill["lazy_ffd@256.measured"] <= 1
    assert fill["lazy_ffd@256"] <= fill["round_bound@256"] + 1e-12
    assert set(result["worker_rss_mb"]) == {f"{m}_ffd@{b}" for m, b in RSS_RUNS}
    assert "packing_overhead" in result["targets"] and "select_100k_s" in result["targets"]
    assert "default.fill.lazy_ffd@256" in result["targets"]


@pytest.mark.parametrize("mode, buffer_size", [("lazy", 16), ("eager", 16), ("lazy", None)])
def test_run_loader_ends_its_workers_before_it_returns(loader_result, mode, buffer_size):
    _, _, work = loader_result
    before = child_pids()
    run = run_loader(
        work / "prepare",
        work / "connect" / "processor",
        mode=mode,
        buffer_size=buffer_size,
        num_workers=1,
        watch_worker=True,
        description="one epoch, one worker",
    )
    assert run.num_samples == 40  # the whole epoch came through the worker
    assert len(run.worker_pids) == 1 and run.peak_rss_mb > 0  # it ran as a child of ours
    assert child_pids() == before  # and it has exited: Energon's workers are persistent
    assert not any(psutil.pid_exists(pid) for pid in run.worker_pids)


def test_run_loader_ends_its_workers_when_stopped_mid_epoch(loader_result):
    _, _, work = loader_result
    before = child_pids()
    run = run_loader(
        work / "prepare",
        work / "connect" / "processor",
        mode="lazy",
        buffer_size=None,
        num_workers=1,
        max_samples=3,
        watch_worker=True,
        description="three conversations, one worker",
    )
    assert run.num_samples == 3 and len(run.worker_pids) == 1
    assert child_pids() == before
    assert not any(psutil.pid_exists(pid) for pid in run.worker_pids)
