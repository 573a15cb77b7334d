"""``packline compare`` for cluster runs (``train.backend: megatron``): Megatron-Bridge trains
one run per launch, with no packed/unpacked pair, so what compares is packer against packer —
the newest finished train stage run of each packer setting in the experiment (``packing.packer``
``bridge`` against ``packline``, and packline's buffer, carry-over and FLOPs balance).

Each such stage run carries the config as params (every stage run does) and, as metrics, the
packs' figures from connect's forecast for its packer (``packing/forecast_*``,
:func:`~packline.packing.forecast.packing_metrics`) and Bridge's own latest metrics nested
under ``megatron/`` (``stages/train_megatron.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from packline import metrics as M
from packline.report.mlflow_store import experiment_runs
from packline.tracking import PARENT_TAG
from schemas.errors import UserError

#: The packer settings that tell cluster runs apart (config params of the stage run).
SETTINGS = (
    "packing.packer",
    "packing.packing_buffer_size",
    "packing.algorithm",
    "packing.max_carry_rounds",
    "packing.balance",
)
#: The packs' figures (metric, label, format).
FIGURES = (
    ("packing/forecast_fill", "fill (real / rows × seq_length)", ".3f"),
    ("packing/forecast_padding_share", "padding share of executed FLOPs", ".3f"),
    ("packing/forecast_straggler_ratio", "straggler ratio (slowest DP rank / mean)", ".3f"),
    ("packing/forecast_rows", "rows per epoch", ",.0f"),
)


@dataclass(kw_only=True)
class ClusterRun:
    """One finished megatron train stage run."""

    run_id: str
    start_time: int
    settings: dict[str, str]
    metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "settings": self.settings, "metrics": self.metrics}


def find_cluster_runs(client, experiment: str, run_id: str | None = None) -> list[ClusterRun]:
    """The newest finished megatron train stage run per packer setting (:data:`SETTINGS`),
    oldest first; ``run_id`` keeps the runs of that pipeline run or stage run. A UserError
    when there is none."""
    runs = experiment_runs(
        client, experiment, f"tags.`{M.TAG_STAGE}` = 'train' and attributes.status = 'FINISHED'"
    )
    newest: dict[tuple[str, ...], ClusterRun] = {}
    for r in runs:  # newest first
        params, metrics = r.data.params, r.data.metrics
        if params.get("train.backend") != "megatron" or "packing/forecast_fill" not in metrics:
            continue
        if run_id and run_id not in (r.info.run_id, r.data.tags.get(PARENT_TAG)):
            continue
        key = tuple(params.get(k, "") for k in SETTINGS)
        newest.setdefault(
            key,
            ClusterRun(
                run_id=r.info.run_id,
                start_time=r.info.start_time,
                settings={k: params.get(k, "") for k in SETTINGS},
                metrics=dict(metrics),
            ),
        )
    if not newest:
        where = f" under run {run_id}" if run_id else ""
        raise UserError(
            [
                f"no finished train.backend=megatron train runs{where} in experiment "
                f"{experiment!r}: run `packline run` with the cluster config first"
            ],
            "nothing to compare",
        )
    return sorted(newest.values(), key=lambda c: c.start_time)


def cluster_table(runs: list[ClusterRun], *, title: str) -> Table:
    """One column per run: its packer settings, the packs' figures and Bridge's metrics."""
    table = Table(title=title)
    table.add_column("")
    for run in runs:
        table.add_column(f"{run.settings['packing.packer']} · {run.run_id[:8]}", justify="right")
    for key in SETTINGS[1:]:
        table.add_row(key, *(run.settings[key] for run in runs))
    for metric, label, fmt in FIGURES:
        table.add_row(
            label,
            *(format(r.metrics[metric], fmt) if metric in r.metrics else "n/a" for r in runs),
        )
    bridge = sorted({k for r in runs for k in r.metrics if k.startswith("megatron/")})
    for key in bridge:
        table.add_row(key, *(f"{r.metrics[key]:.4g}" if key in r.metrics else "" for r in runs))
    return table
