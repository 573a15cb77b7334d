"""Packing on against off, read back from an MLflow store: the figures of the newest (or a
chosen) pair of training runs, their plots and ``compare.json``.

Every figure comes from the metric histories the train stage logged, summed by the same
:func:`~packline.report.summary.summarize_run` as the stage's own summary: nothing is
recomputed from the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from packline.report.mlflow_store import TrainingPair, read_training_run
from packline.report.plots import PLOTS, write_plots
from packline.report.summary import PackingComparison, RunSummary
from packline.report.table import summary_table
from packline.tracking import Tracker

COMPARE_DIR = "compare"
"""The artifact folder (on the pipeline run) and the folder under the work dir."""
SUMMARY_FILE = "compare.json"


@dataclass(kw_only=True)
class Comparison:
    """A compared pair of training runs and where they are in the store."""

    experiment: str
    experiment_id: str
    tracking_uri: str
    pipeline_run_id: str | None
    pipeline_run_name: str | None
    stage_run_id: str
    pair: PackingComparison
    plots: list[str]

    @property
    def packed(self) -> RunSummary:
        return self.pair.packed

    @property
    def unpacked(self) -> RunSummary:
        return self.pair.unpacked

    @property
    def speedup_real_tokens_per_s(self) -> float:
        return self.pair.speedup

    def to_dict(self) -> dict[str, Any]:
        """``compare.json``: where the runs are, each run's summary, the pair's ratios."""
        return {
            "experiment": self.experiment,
            "experiment_id": self.experiment_id,
            "tracking_uri": self.tracking_uri,
            "pipeline_run_id": self.pipeline_run_id,
            "pipeline_run_name": self.pipeline_run_name,
            "stage_run_id": self.stage_run_id,
            "packed": self.packed.to_dict(),
            "unpacked": self.unpacked.to_dict(),
            **self.pair.ratios(),
            "plots": self.plots,
        }


def compare_pair(client, pair: TrainingPair, out: Path, *, tracking_uri: str) -> Comparison:
    """Read both runs of ``pair``, write the plots and ``compare.json`` to ``out`` and log
    them to the pair's pipeline run (else its stage run) under :data:`COMPARE_DIR`."""
    packed, packed_hist = read_training_run(client, pair.packed)
    unpacked, unpacked_hist = read_training_run(client, pair.unpacked)
    comparison = PackingComparison(packed=packed, unpacked=unpacked)
    hist = {"packed": packed_hist, "unpacked": unpacked_hist}
    plots = write_plots(out, hist, comparison, packed.seq_length)
    pipeline = pair.pipeline_run
    result = Comparison(
        experiment=pair.experiment_name,
        experiment_id=pair.experiment_id,
        tracking_uri=tracking_uri,
        pipeline_run_id=pipeline.info.run_id if pipeline else None,
        pipeline_run_name=pipeline.info.run_name if pipeline else None,
        stage_run_id=pair.stage_run_id,
        pair=comparison,
        plots=[str(p) for p in plots],
    )
    summary = out / SUMMARY_FILE
    summary.write_text(json.dumps(result.to_dict(), indent=2))
    tracker = Tracker(client, pair.log_run_id)
    for path in [*plots, summary]:
        tracker.log_artifact(path, COMPARE_DIR)
    return result


def comparison_table(c: Comparison) -> Table:
    """:func:`~packline.report.table.summary_table` of the pair, titled with where it is."""
    where = (
        f"pipeline run {c.pipeline_run_name} ({c.pipeline_run_id[:8]})"
        if c.pipeline_run_id
        else f"train stage run {c.stage_run_id[:8]}"
    )
    return summary_table(
        c.pair.runs,
        title=f"packing on vs off · experiment {c.experiment} · {where}",
        source=f"from {c.tracking_uri}",
    )


__all__ = ["COMPARE_DIR", "PLOTS", "Comparison", "compare_pair", "comparison_table"]
