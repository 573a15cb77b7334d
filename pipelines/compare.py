"""``packline compare``: packing on vs off, read back from the config's MLflow store.

The runs compared are the ``train-packed`` and ``train-unpacked`` child runs of the latest
finished train stage of the experiment (or of the pipeline / train-stage run passed as
``run_id``). Prints the table, writes the plots and ``compare.json`` to
``<work>/compare/`` and logs them to the pipeline's parent run
(:mod:`packline.report.compare`).

For a cluster config (``train.backend: megatron``) the runs compared are the newest cluster
train run of each packer setting, Bridge's own packer against packline's
(:mod:`packline.report.cluster`): the table, and ``<work>/compare/cluster.json``.
"""

from __future__ import annotations

import json

from packline.backends import backend
from packline.report.cluster import ClusterRun, cluster_table, find_cluster_runs
from packline.report.compare import (
    COMPARE_DIR,
    PLOTS,
    Comparison,
    compare_pair,
    comparison_table,
)
from packline.report.mlflow_store import find_training_pair, open_store
from packline.tracking import experiment_name, tracking_uri
from schemas.config import PipelineConfig

CLUSTER_FILE = "cluster.json"


def compare_runs(
    cfg: PipelineConfig, *, experiment: str | None = None, run_id: str | None = None
) -> Comparison | list[ClusterRun]:
    """Read the newest packed/unpacked pair, print the table, write and log the plots (for a
    cluster config: the cluster runs per packer, their table and ``cluster.json``)."""
    from packline.progress import wide_console

    client = open_store(cfg)
    if backend(cfg).compares_packers:
        name = experiment or experiment_name(cfg)
        runs = find_cluster_runs(client, name, run_id)
        out = cfg.work_path / COMPARE_DIR
        out.mkdir(parents=True, exist_ok=True)
        (out / CLUSTER_FILE).write_text(json.dumps([r.to_dict() for r in runs], indent=2))
        console = wide_console()
        title = f"cluster runs by packer · experiment {name} · from {tracking_uri(cfg)}"
        console.print(cluster_table(runs, title=title))
        console.print(f"written: {out / CLUSTER_FILE}")
        return runs
    pair = find_training_pair(client, experiment or experiment_name(cfg), run_id)
    out = cfg.work_path / COMPARE_DIR
    result = compare_pair(client, pair, out, tracking_uri=tracking_uri(cfg))
    console = wide_console()  # stdout: the table is this command's output
    console.print(comparison_table(result))
    console.print(f"plots: {out}/{{{','.join(PLOTS)}}}")
    console.print(f"logged to MLflow run {pair.log_run_id} under artifacts/{COMPARE_DIR}/")
    return result
