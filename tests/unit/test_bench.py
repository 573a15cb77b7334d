"""packline.bench as library code: the length generator, the simulated fills, the targets,
the tables, and the RSS watcher and child-process checks of the loader measurement (the real
loader runs in tests/integration/test_bench_loader.py)."""

from __future__ import annotations

import doctest
import io
import statistics
import subprocess
import sys
import time

import pytest
from rich.console import Console

from packline.bench import data, lengths, loader, processes, simulation, targets
from packline.bench.lengths import VlmSftShape, shuffled, vlm_sft_lengths, vlm_sft_samples
from packline.bench.loader import LoaderRun, torch_threads
from packline.bench.processes import WorkerRss, child_pids, wait_for_exit
from packline.bench.simulation import (
    cluster_packing,
    fill_by_method,
    fill_summary,
    lower_bound_fill,
    packed_fill,
    round_bound_fill,
    time_selection,
    unpacked_capacity,
)
from packline.bench.tables import print_loader_report, print_packing_tables
from packline.bench.targets import loader_targets, packing_targets
from packline.packing.forecast import simulate_packing


@pytest.mark.parametrize("module", [lengths, simulation, targets, processes, loader, data])
def test_docstrings_have_worked_examples(module):  # pytest --doctest-modules runs them
    assert any(t.examples for t in doctest.DocTestFinder().find(module))


@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "refined"])
def test_packed_fill_buffers_cut_the_stream_and_drop_overlength(algorithm):
    stream = [6, 5, 4, 3, 12, 2]  # capacity 10: the 12 takes a slot and no row; 20 tokens
    fill = {
        b: packed_fill(stream, capacity=10, buffer_size=b, algorithm=algorithm)
        for b in (1, 2, 3, 6, None)
    }
    # 1: one row per fitting sample; 2: [6][5] [4,3] [2]; 3: [6,4][5] [3,2]; one buffer:
    # [6,4][5,3,2]
    assert fill == {1: 20 / 50, 2: 20 / 40, 3: 20 / 30, 6: 20 / 20, None: 20 / 20}
    assert packed_fill([], capacity=10, buffer_size=4, algorithm=algorithm) == 0.0
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        packed_fill(stream, capacity=10, buffer_size=0, algorithm=algorithm)


def test_packed_fill_plain_ffd_and_bfd_leave_the_row_refined_closes():
    # One buffer of 6: 20 tokens; FFD and BFD need 3 rows of 10, refined 2.
    stream = [4, 4, 3, 3, 3, 3]
    assert packed_fill(stream, capacity=10, buffer_size=6, algorithm="ffd") == 20 / 30
    assert packed_fill(stream, capacity=10, buffer_size=6, algorithm="bfd") == 20 / 30
    assert packed_fill(stream, capacity=10, buffer_size=6, algorithm="refined") == 1.0
    assert round_bound_fill(stream, capacity=10, buffer_size=6) == 1.0
    assert round_bound_fill(stream, capacity=10, buffer_size=3) == 20 / 30  # 11 → 2, 9 → 1


def test_unpacked_capacity_pads_each_batch_to_its_longest():
    # fitting samples [6, 5, 4, 3, 2] in batches of 2: 2x6 + 2x4 + 1x2
    assert unpacked_capacity([6, 5, 4, 3, 12, 2], capacity=10, batch_size=2) == 22
    assert unpacked_capacity([1, 9, 2, 3], capacity=10, batch_size=8) == 4 * 9
    assert unpacked_capacity([], capacity=10, batch_size=8) == 0


def test_lower_bound_fill_rounds_rows_up():
    assert lower_bound_fill([6, 5, 4, 3, 12, 2], 10) == 1.0  # 20 tokens, 2 rows
    assert lower_bound_fill([6, 5], 10) == 11 / 20
    assert lower_bound_fill([12], 10) == 0.0


def test_fill_by_method_exact_on_equal_lengths():
    # Twenty samples of 3 tokens, capacity 10: three per row. Order does not matter.
    fill = fill_by_method([3] * 20, capacity=10, seed=0)
    assert list(fill) == [
        "none",
        "eager_ffd@16",
        "lazy_ffd@16",
        "lazy_ffd@64",
        "lazy_ffd@256",
        "lazy_ffd@1024",
        "lazy_bfd@16",
        "lazy_bfd@64",
        "lazy_bfd@256",
        "lazy_bfd@1024",
        "lazy_refined@16",
        "lazy_refined@64",
        "lazy_refined@256",
        "lazy_refined@1024",
        "carry_refined@16",
        "carry_refined@64",
        "carry_refined@256",
        "carry_refined@1024",
        "offline_bfd",
        "round_bound@16",
        "round_bound@64",
        "round_bound@256",
        "round_bound@1024",
        "lower_bound",
    ]
    assert fill["none"] == 1.0  # every batch is padded to 3
    # B=16: 16 samples → 6 rows (5 of 3 samples, 1 of 1); the last 4 → 2 rows: 60 / 80
    assert fill["lazy_ffd@16"] == fill["lazy_bfd@16"] == fill["eager_ffd@16"] == 0.75
    assert fill["lazy_refined@16"] == 0.75  # already the fewest rows per round
    for name in ("lazy_ffd@64", "lazy_bfd@1024", "lazy_refined@64", "offline_bfd"):
        assert fill[name] == 60 / 70  # one buffer: 7 rows
    assert fill["lower_bound"] == 1.0  # 60 tokens fit 6 rows exactly
    # B=16: 48 tokens need ≥ 5 rows, the last 12 tokens ≥ 2 rows
    assert fill["round_bound@16"] == 60 / 70
    assert fill["round_bound@64"] == 1.0


def test_fill_by_method_eager_equals_lazy_and_is_bounded():
    lengths = vlm_sft_lengths(3000, seed=5)
    fill = fill_by_method(lengths, capacity=2048, seed=1)
    assert fill["eager_ffd@16"] == fill["lazy_ffd@16"]
    assert all(0 < v <= 1 for v in fill.values())
    assert all(fill[name] <= fill["lower_bound"] for name in fill)
    for b in (16, 64, 256, 1024):
        assert fill[f"lazy_ffd@{b}"] <= fill[f"lazy_refined@{b}"] <= fill[f"round_bound@{b}"]
        assert fill[f"lazy_bfd@{b}"] <= fill[f"round_bound@{b}"]
    assert fill["lazy_refined@256"] > 0.99 * fill["round_bound@256"]
    assert fill["none"] < fill["lazy_ffd@16"] < fill["lazy_ffd@256"] <= fill["offline_bfd"]
    with pytest.raises(ValueError, match="no sample fits"):
        fill_by_method([4000], capacity=2048, seed=0)


def test_shuffled_is_a_seeded_permutation():
    lengths = list(range(100))
    assert shuffled(lengths, 3) == shuffled(lengths, 3)
    assert shuffled(lengths, 3) != shuffled(lengths, 4)
    assert sorted(shuffled(lengths, 3)) == lengths
    assert lengths == list(range(100))  # input untouched


def test_vlm_sft_samples_are_deterministic_and_in_range():
    shape = VlmSftShape()
    samples = vlm_sft_samples(5000, seed=0)
    assert samples == vlm_sft_samples(5000, seed=0)
    assert samples != vlm_sft_samples(5000, seed=1)
    assert vlm_sft_samples(100, seed=0) == samples[:100]
    for text, images in samples:
        assert 16 <= text <= shape.text_max
        assert 0 <= len(images) <= 4
        assert all(shape.image_tokens_min <= n <= shape.image_tokens_max for n in images)
        assert sum(images) <= shape.visual_budget
    counts = [len(images) for _, images in samples]
    assert abs(counts.count(0) / len(counts) - 0.35) < 0.03
    assert abs(counts.count(4) / len(counts) - 0.05) < 0.015
    assert 200 <= statistics.median(t for t, _ in samples) <= 240
    assert vlm_sft_lengths(50, seed=0) == [t + sum(v) for t, v in samples[:50]]
    # Heavy tail: some, but few, conversations do not fit 2048 tokens.
    overlength = sum(n > 2048 for n in vlm_sft_lengths(5000, seed=0)) / 5000
    assert 0.02 < overlength < 0.10


def test_vlm_sft_shape_rejects_a_budget_too_small_for_its_images():
    with pytest.raises(ValueError, match="raise it to at least 1024"):
        VlmSftShape(visual_budget=1000)
    with pytest.raises(ValueError, match="image_tokens_min <= image_tokens_max"):
        VlmSftShape(image_tokens_min=600, image_tokens_max=500)


def test_worker_rss_sees_a_new_child_only():
    with WorkerRss(interval_s=0.02) as rss:
        assert rss.sample() == 0.0  # no child yet
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; x = b'x' * (64 * 2**20); time.sleep(1.5)"]
        )
        child.wait()
    assert rss.peak_mb >= 64


def _result(*, fill256: float, offline: float, rss256: float, overhead: float, select: float):
    """Figures whose targets all hold or all fail together (carry-over's fill above the lazy
    fill at 256 from 0.99 on, else below 0.97; its ms per sample twice the 100k lengths'
    seconds)."""
    fill = {
        "lazy_ffd@256": fill256,
        "lazy_bfd@256": fill256,
        "lazy_refined@256": fill256,
        "offline_bfd": offline,
        "round_bound@256": fill256,
    }
    carry_fill = fill256 + 0.005 if fill256 >= 0.99 else fill256 - 0.02
    carry = {"fill": carry_fill, "select_ms_per_sample": 2 * select}
    cluster = {}
    for b in (16, 64):
        fill[f"carry_refined@{b}"] = carry_fill
        fill[f"round_bound@{b}"] = fill256
        cluster[f"packline_carry@{b}"] = carry
        cluster[f"packline_refined@{b}"] = {"round_bound_fill": fill256}
    return {
        "default": {"fill": fill},
        "vlm_sft": {"fill": fill},
        "cluster": {"vlm_sft": cluster},
        "worker_rss_mb": {"eager_ffd@16": 700.0, "lazy_ffd@256": rss256},
        "packing_overhead": overhead,
        "select_100k_s": select,
    }


def test_targets_hold_or_not():
    good = packing_targets(
        _result(fill256=0.99, offline=0.995, rss256=600.0, overhead=0.03, select=0.5)
    )
    assert all(t["held"] for t in good.values())
    # 2 sets × 3 algorithms, carry-over's fill (2 sets × 2 buffers) and selection time,
    # worker RSS, overhead, selection time
    assert len(good) == 14
    bad = packing_targets(
        _result(fill256=0.985, offline=0.9999, rss256=701.0, overhead=0.06, select=1.0)
    )
    assert not any(t["held"] for t in bad.values())
    assert bad["default.fill.lazy_ffd@256"]["vs_offline_bfd"] == pytest.approx(0.985 / 0.9999)
    assert bad["default.fill.lazy_ffd@256"]["vs_round_bound"] == 1.0
    low = packing_targets(
        _result(fill256=0.975, offline=0.976, rss256=600.0, overhead=0.0, select=0.1)
    )
    assert not low["vlm_sft.fill.lazy_bfd@256"]["held"]  # within 1% but under 0.98


def test_torch_threads_sets_and_restores():
    import torch

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_fill_summary_counts_overlength_beside_the_fills():
    lengths = [3] * 20 + [11, 12]
    summary = fill_summary(lengths, capacity=10, seed=0)
    assert list(summary) == ["samples", "overlength", "fill"]
    assert summary["samples"] == 22 and summary["overlength"] == 2
    assert summary["fill"] == fill_by_method(lengths, capacity=10, seed=0)


def test_time_selection_times_every_algorithm():
    seconds = time_selection(vlm_sft_lengths(500, seed=0), capacity=2048, repeats=2)
    assert list(seconds) == ["ffd", "bfd", "refined"]
    assert all(0 < s < 5 for s in seconds.values())
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_selection([1], capacity=10, repeats=0)


def test_loader_targets_hold_at_their_bounds():
    t = loader_targets(
        {"worker_rss_mb": {"eager_ffd@16": 700.0, "lazy_ffd@256": 700.0}, "packing_overhead": 0.05}
    )
    assert list(t) == ["worker_rss_mb.lazy_ffd@256", "packing_overhead"]
    assert t["worker_rss_mb.lazy_ffd@256"] == {
        "held": True,
        "value": 1.0,
        "rule": "<= 1x eager_ffd@16",
    }
    assert t["packing_overhead"] == {"held": True, "value": 0.05, "rule": "<= 0.05"}


def test_worker_rss_records_the_new_childs_pid():
    with WorkerRss(interval_s=0.02) as rss:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        child.wait()
    assert rss.pids == {child.pid}
    assert rss.start_mb is not None and 0 < rss.start_mb <= rss.peak_mb


def test_wait_for_exit_names_a_child_still_running_and_returns_once_it_ended():
    before = child_pids()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    assert child_pids() == before | {child.pid}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"processes \[{child.pid}\] still run 0.2 s"):
        wait_for_exit(before, timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    wait_for_exit(before, timeout_s=30)
    assert child_pids() == before
    wait_for_exit(before, timeout_s=0)  # nothing new: returns at once


def _runs() -> tuple[dict, dict[str, LoaderRun], dict[str, list[LoaderRun]]]:
    """Figures as measure_loader returns them, made up."""
    loader_runs = {
        "eager_ffd@16": LoaderRun(
            num_items=12, num_samples=40, real_tokens=20000, seconds=3.0,
            peak_rss_mb=700.0, first_rss_mb=650.0, start_rss_mb=600.0,
        ),
        "lazy_ffd@256": LoaderRun(
            num_items=10, num_samples=40, real_tokens=20000, seconds=2.5,
            peak_rss_mb=500.0, first_rss_mb=480.0, start_rss_mb=None,
        ),
    }  # fmt: skip
    throughput = {
        "encode_only": [LoaderRun(num_items=40, num_samples=40, real_tokens=1, seconds=4.0)],
        "lazy_ffd@256": [LoaderRun(num_items=10, num_samples=40, real_tokens=1, seconds=5.0)],
    }
    result = {
        "fill_measured": 0.95,
        "worker_rss_mb": {"eager_ffd@16": 700.0, "lazy_ffd@256": 500.0},
        "worker_rss_growth_mb": {"eager_ffd@16": 50.0, "lazy_ffd@256": 20.0},
        "samples_per_s": {"encode_only": 10.0, "lazy_ffd@256": 8.0},
        "packing_overhead": 0.2,
    }
    return result, loader_runs, throughput


def _render(fn, *args) -> str:
    out = Console(file=io.StringIO(), width=250, color_system=None)
    fn(out, *args)
    return out.file.getvalue()


def _rows(text: str) -> dict[str, list[str]]:
    """Every table row of ``text``: first cell → the other cells, stripped (a name that
    starts rows in two tables keeps its first table's row)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("│ "):
            cells = [c.strip() for c in line.split("│")[1:-1]]
            rows.setdefault(cells[0], cells[1:])
    return rows


def test_loader_report_prints_every_run_and_the_targets():
    result, loader_runs, throughput = _runs()
    result["targets"] = loader_targets(result)
    text = _render(print_loader_report, result, loader_runs, throughput)
    assert text.startswith("loader worker on the default set (num_workers=1, one epoch)")
    rows = _rows(text)
    assert rows["eager_ffd@16"] == ["12", "600", "650", "700", "50", "3.0"]
    assert rows["lazy_ffd@256"] == ["10", "-", "480", "500", "20", "2.5"]
    assert rows["samples/s encode_only"] == ["10.0 (best of 10.0; 40 each)"]
    assert rows["samples/s lazy_ffd@256"] == ["8.0 (best of 8.0; 40 each)"]
    assert rows["packing overhead"] == ["+20.0%"]
    assert "fill of lazy_ffd@256 through the loader: 0.9500" in text
    assert rows["packing_overhead"] == ["0.2000", "<= 0.05", "no"]
    assert rows["worker_rss_mb.lazy_ffd@256"] == ["0.7143", "<= 1x eager_ffd@16", "yes"]


def test_packing_tables_print_each_distributions_fills_and_the_selection_time():
    result, loader_runs, throughput = _runs()
    result["default"] = fill_summary([3] * 20 + [4000], capacity=2048, seed=0)
    result["vlm_sft"] = fill_summary(vlm_sft_lengths(200, seed=0), capacity=2048, seed=0)
    result["default"]["fill"]["lazy_ffd@256.measured"] = result.pop("fill_measured")
    result["select_100k_s"] = 0.25
    result["cluster"] = {
        "default": cluster_packing([3] * 20 + [4000], capacity=4096, seed=0),
        "vlm_sft": cluster_packing(vlm_sft_lengths(200, seed=0), capacity=4096, seed=0),
    }
    result["targets"] = packing_targets(result)
    select_s = {"ffd": 0.125, "bfd": 0.25, "refined": 0.2}
    text = _render(print_packing_tables, result, loader_runs, throughput, select_s, 500)
    words = " ".join(text.split())  # titles and captions wrap to their table's width
    assert "fill at seq_length 2048: default set — 21 samples, 1 overlength (dropped)" in words
    assert "fill at seq_length 2048: synthetic VLM SFT — 200 samples, " in words
    assert ".measured = the real Energon loader, one epoch (its own stream order)" in words
    assert text.count("│ lower_bound ") == 2  # one fill table per distribution
    rows = _rows(text)  # the default set's fills: its table comes first
    # Twenty samples of 3 in one row of 2048: every packer and the bound fill 60 / 2048.
    assert rows["lower_bound"] == [f"{60 / 2048:.4f}", "1.0000"]
    assert rows["lazy_ffd@256.measured"] == ["0.9500", f"{0.95 / (60 / 2048):.4f}"]
    assert rows["select_packs ffd, 500 lengths"] == ["0.125 s"]
    assert rows["select_packs refined, 500 lengths"] == ["0.200 s"]
    assert rows["select_100k_s"] == ["0.2500", "< 1 s, the slowest algorithm", "yes"]
    assert rows["default.fill.lazy_ffd@256"][0].startswith(f"{60 / 2048:.4f} (1.0000x offline")
    assert rows["default.fill.lazy_ffd@256"][-1] == "no"
    assert rows["packing overhead"] == ["+20.0%"]
    assert "cluster packing at seq_length 4096: default set" in words
    # 21 samples (4,060 tokens) in Bridge's rounds of 16 and 5: a row each
    assert rows["bridge_ffd@16"][:3] == [f"{4060 / 8192:.4f}", "4,132", "2"]


def test_cluster_packing_packs_the_same_tokens_every_way_and_bridge_is_plain_ffd():
    lengths = vlm_sft_lengths(2000, seed=7)
    capacity = 4096
    c = cluster_packing(lengths, capacity=capacity, seed=3)
    assert set(c) == {
        "bridge_ffd@16", "bridge_ffd@32", *(f"packline_{m}@{b}" for m in ("refined", "carry")
                                            for b in (16, 64, 256))
    }  # fmt: skip
    tokens = {name: f["rows"] * capacity - f["padding_tokens"] for name, f in c.items()}
    assert len(set(tokens.values())) == 1  # every packer packs every sample that fits, once
    for name, f in c.items():
        assert f["fill"] == pytest.approx(tokens[name] / (f["rows"] * capacity))
        assert f["select_ms_per_sample"] > 0
    for b in (16, 64, 256):  # without carry-over no packer beats the per-round bound
        refined = c[f"packline_refined@{b}"]
        assert refined["fill"] <= refined["round_bound_fill"] + 1e-12
    for f in c.values():  # and no packer at all beats the buffer bound
        assert f["fill"] <= f["buffer_bound_fill"] + 1e-12
    stream = shuffled(lengths, 3)
    bridge = simulate_packing(
        stream, capacity=capacity, buffer_size=16, algorithm="ffd", backend="megatron"
    )
    assert c["bridge_ffd@16"]["rows"] == bridge.packs
