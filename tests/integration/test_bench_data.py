"""``packline bench data`` as a user runs it (a subprocess, a small set): prepare and
connect with 1 and 2 workers on the same rows, their process trees' peak RSS at two sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.slow


def test_bench_data_cli_measures_both_stages_per_worker_count_and_size(tmp_path):
    out = subprocess.run(
        [
            sys.executable, "-m", "pipelines.cli", "bench", "data", "data.video_share=0.1",
            "--json", "--work-dir", str(tmp_path), "--samples", "200",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    runs = {(r["stage"], r["samples"], r["workers"], r["variant"]): r for r in result["runs"]}
    assert set(runs) == {
        (stage, n, w, "long_row" if n == 51 else "")
        for stage in ("prepare", "connect")
        for n, w in ((200, 1), (200, 2), (50, 2), (51, 2))
    } | {("prepare", 200, 2, "parquet"), ("prepare", 50, 2, "parquet")}
    # the same rows as Parquet, media embedded: every row read, beside the folder
    parquet = result["figures"]["prepare.parquet"]
    assert parquet["vs_folder"] == pytest.approx(
        parquet["samples_per_s"]["2"] / result["figures"]["prepare"]["samples_per_s"]["2"],
        rel=1e-2,
    )
    assert set(parquet["rss_mib"]) == {"50", "200"}
    assert result["targets"]["prepare.parquet.vs_folder"]["value"] == parquet["vs_folder"]
    from_parquet = tmp_path / "data" / "parquet-large-w2" / "prepare" / "manifest.parquet"
    from_folder = tmp_path / "data" / "large-w2" / "prepare" / "manifest.parquet"
    assert (
        pd.read_parquet(from_parquet)
        .drop(columns="shard")
        .equals(pd.read_parquet(from_folder).drop(columns="shard"))
    )
    assert [r["variant"] for r in result["runs"] if r["samples"] == 51] == ["long_row"] * 2
    assert all(r["samples_per_s"] > 0 and r["peak_rss_mib"] > 100 for r in runs.values())
    for stage in ("prepare", "connect"):
        f = result["figures"][stage]
        rates = f["samples_per_s"]
        assert f["speedup_2_vs_1"] == pytest.approx(rates["2"] / rates["1"], rel=1e-2)
        assert f["projected_hours_1e6_per_core"] == pytest.approx(1e6 / rates["1"] / 3600, rel=1e-2)
        assert set(f["rss_mib"]) == {"50", "200"}
        assert result["targets"][f"{stage}.rss_growth"]["value"] == f["rss_growth"]
    # one more conversation, of prepare.max_text_chars characters: accepted, and measured
    long_row = result["figures"]["connect"]["long_row_rss_mib"]
    assert long_row["with"] == runs[("connect", 51, 2, "long_row")]["peak_rss_mib"].__round__(1)
    assert long_row["without"] == runs[("connect", 50, 2, "")]["peak_rss_mib"].__round__(1)
    assert result["targets"]["connect.long_row_rss"]["value"] == long_row["added"]
    long_manifest = tmp_path / "data" / "small-long-w2" / "prepare" / "manifest.parquet"
    assert list(pd.read_parquet(long_manifest)["text_chars"])[-1] == 1_000_000 - 13
    # both sizes are the same rows: the small set is the large one's first 50
    large = tmp_path / "data" / "large-w1" / "prepare" / "manifest.parquet"
    small = tmp_path / "data" / "small-w2" / "prepare" / "manifest.parquet"
    assert list(pd.read_parquet(small)["id"]) == list(pd.read_parquet(large)["id"])[:50]
