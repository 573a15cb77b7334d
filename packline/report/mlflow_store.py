"""The training runs read back from an MLflow store, into the same :class:`RunSummary`.

Run layout in the store (what the stages write)::

    pipeline-<time>            tag packline.kind=pipeline
      └ train                  tag packline.stage=train (the stage run)
          ├ train-packed       tags packline.stage=train, packline.packing=true
          └ train-unpacked     tags packline.stage=train, packline.packing=false

A training run's metric histories become step and eval records
(:func:`records_from_histories`), then :func:`~packline.report.summary.summarize_run`
sums them as it does the lines of ``metrics.jsonl`` and ``eval.jsonl``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from packline import metrics as M
from packline.report.summary import EVAL_INPUTS, STEP_INPUTS, RunSummary, summarize_run
from packline.tracking import PARENT_TAG, relocate_artifacts, sqlite_path, tracking_uri
from schemas.config import PipelineConfig
from schemas.errors import UserError

READS = (
    *STEP_INPUTS,
    *EVAL_INPUTS,
    M.EVAL_ACCURACY_CHANCE,
    M.cumulative(M.TRAIN_TOKENS_REAL),
    M.THROUGHPUT_REAL_TOKENS_PER_S,
    M.PACK_ROW_FILL,
)
"""The metric histories ``packline compare`` reads of every training run (besides the
:func:`packline.metrics.eval_kind` ones the run has)."""

History = dict[str, list[tuple[int, float]]]
"""Metric name → (step, value) in step order."""


@dataclass
class TrainingPair:
    """The two training runs compared, and the runs above them."""

    experiment_id: str
    experiment_name: str
    packed: Any
    """The ``mlflow.entities.Run`` of packing on."""
    unpacked: Any
    stage_run_id: str
    pipeline_run: Any | None
    """The pipeline's parent run; None for ``packline stage train``."""

    @property
    def log_run_id(self) -> str:
        """Where the comparison's artifacts go: the pipeline run, else the train stage run."""
        return self.pipeline_run.info.run_id if self.pipeline_run else self.stage_run_id


def open_store(cfg: PipelineConfig, header: str = "nothing to compare"):
    """An ``MlflowClient`` on the config's store; ``UserError`` (under ``header``) when
    MLflow is off or the sqlite store does not exist yet (opening it would create one)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not cfg.mlflow.enabled:
        raise UserError(
            ["mlflow.enabled is false in this config: the stages logged nothing"], header
        )
    uri = tracking_uri(cfg)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        problem = f"no MLflow store at {db}: run `packline run` (same config) first"
        raise UserError([problem], header)
    relocate_artifacts(cfg)  # a work dir copied or moved: its artifacts are where it is now
    return MlflowClient(tracking_uri=uri)


def _search(client, experiment_id: str, filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=filter_string,
            order_by=["attributes.start_time DESC"],
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _experiment(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(
            [
                f"no MLflow experiment named {experiment!r} in this store "
                "(the experiment is mlflow.experiment, else the pipeline name)"
            ],
            "nothing to compare",
        )
    return exp


def experiment_runs(client, experiment: str, filter_string: str) -> list:
    """Every run of ``experiment`` matching ``filter_string``, newest first; a UserError when
    the store has no such experiment."""
    return _search(client, _experiment(client, experiment).experiment_id, filter_string)


def find_training_pair(client, experiment: str, run_id: str | None = None) -> TrainingPair:
    """The newest finished ``train-packed``/``train-unpacked`` pair of one train stage run.

    ``run_id`` narrows it to one pipeline run or one train stage run. A pipeline run whose
    train stage was skipped (up to date) has no training runs of its own: the newest pair
    is then the one that stage's record came from.
    """
    exp = _experiment(client, experiment)
    runs = _search(
        client,
        exp.experiment_id,
        f"tags.`{M.TAG_STAGE}` = 'train' and attributes.status = 'FINISHED'",
    )
    by_stage: dict[str, dict[str, Any]] = {}
    for r in runs:  # newest first: keep the newest of each mode under each stage run
        mode = r.data.tags.get(M.TAG_PACKING)
        parent = r.data.tags.get(PARENT_TAG)
        if mode is None or parent is None:
            continue  # the stage run itself
        by_stage.setdefault(parent, {}).setdefault(mode, r)
    pairs = [(stage, m) for stage, m in by_stage.items() if {"true", "false"} <= set(m)]
    stage_parents = {stage: client.get_run(stage).data.tags.get(PARENT_TAG) for stage, _ in pairs}
    if run_id:
        pairs = [(s, m) for s, m in pairs if run_id in (s, stage_parents[s])]
    if not pairs and run_id:
        raise UserError(
            [
                f"no finished train-packed and train-unpacked runs under run {run_id}: pass "
                f"a pipeline or train-stage run id of experiment {experiment!r}"
            ],
            "nothing to compare",
        )
    if not pairs:
        raise UserError(
            [
                f"no finished train-packed and train-unpacked runs in experiment "
                f"{experiment!r}: run `packline run` with train.compare_packing=true "
                "(the default) first"
            ],
            "nothing to compare",
        )
    stage, modes = max(pairs, key=lambda p: max(r.info.start_time for r in p[1].values()))
    pipeline_id = stage_parents[stage]
    return TrainingPair(
        experiment_id=exp.experiment_id,
        experiment_name=experiment,
        packed=modes["true"],
        unpacked=modes["false"],
        stage_run_id=stage,
        pipeline_run=client.get_run(pipeline_id) if pipeline_id else None,
    )


def metric_histories(client, run_id: str, keys: Iterable[str]) -> History:
    """``keys`` of one run as (step, value) sorted by step; a step logged twice keeps its
    last value; a key never logged has an empty history."""
    out = {}
    for key in keys:
        by_step: dict[int, tuple[int, float]] = {}
        for m in client.get_metric_history(run_id, key):
            if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                by_step[m.step] = (m.timestamp, m.value)
        out[key] = [(step, v) for step, (_, v) in sorted(by_step.items())]
    return out


def _is_eval(name: str) -> bool:
    return name.startswith("eval/")


def records_from_histories(hist: Mapping[str, list[tuple[int, float]]]) -> tuple[list, list]:
    """(step records, eval records) of one run's histories: the records
    :func:`~packline.report.summary.summarize_run` reads. A step record is every non-eval
    metric at a step that has ``train/loss``; an eval record every eval metric at a step
    that has ``eval/loss``, the per-kind ones as ``by_kind``. ``pack/row_fill`` (one value
    per row, not per step) and the once-logged chance are left out.

    >>> records_from_histories({"train/loss": [(1, 2.0)], "eval/loss": [(0, 3.0), (1, 1.0)],
    ...                         "eval/by_kind/count/accuracy": [(1, 0.5)]})
    ([{'step': 1, 'train/loss': 2.0}], [{'step': 0, 'eval/loss': 3.0}, \
{'step': 1, 'eval/loss': 1.0, 'by_kind': {'count': {'accuracy': 0.5}}}])
    """
    by_step: dict[int, dict[str, float]] = {}
    for key, points in hist.items():
        if key in (M.PACK_ROW_FILL, M.EVAL_ACCURACY_CHANCE) or key.endswith("/chance"):
            continue
        for step, value in points:
            by_step.setdefault(step, {})[key] = value
    steps, evals = [], []
    for step in sorted(by_step):
        values = by_step[step]
        if M.TRAIN_LOSS in values:
            steps.append({"step": step, **{k: v for k, v in values.items() if not _is_eval(k)}})
        if M.EVAL_LOSS in values:
            plain = {k: v for k, v in values.items() if _is_eval(k) and "/by_kind/" not in k}
            record = {"step": step, **plain}
            if by_kind := M.by_kind_from_metrics(values):
                record[M.EVAL_BY_KIND] = by_kind
            evals.append(record)
    return steps, evals


def _run_name(run) -> str:
    return "packed" if run.data.tags.get(M.TAG_PACKING) == "true" else "unpacked"


def read_training_run(client, run) -> tuple[RunSummary, History]:
    """The summary of one training run of the store, and the histories it came from (the
    plots draw them). ``UserError`` when the run lacks a metric the summary reads."""
    kind_keys = [k for k in run.data.metrics if k.startswith("eval/by_kind/")]
    hist = metric_histories(client, run.info.run_id, [*READS, *kind_keys])
    steps, evals = records_from_histories(hist)
    params, tags, latest = run.data.params, run.data.tags, run.data.metrics
    chance_by_kind = {
        kind: v["chance"]
        for kind, v in M.by_kind_from_metrics(latest).items()
        if v.get("chance") is not None
    }
    end = run.info.end_time
    try:
        summary = summarize_run(
            steps,
            evals,
            run=_run_name(run),
            seq_length=int(params.get("packing.seq_length", 0)),
            precision=tags.get(M.TAG_PRECISION) or params.get("train.precision", "?"),
            ranks=int(tags.get(M.TAG_RANKS) or params.get("train.nproc_per_node", 1)),
            chance=latest.get(M.EVAL_ACCURACY_CHANCE),
            chance_by_kind=chance_by_kind or None,
            wall_seconds=(end - run.info.start_time) / 1000 if end else None,
            run_id=run.info.run_id,
        )
    except ValueError as exc:
        raise UserError(
            [f"run {run.info.run_id} ({run.info.run_name}): {exc}"], "nothing to compare"
        ) from exc
    return summary, hist


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    """The MLflow UI page comparing ``run_ids`` (hash route of the single-page app).

    >>> compare_url("http://127.0.0.1:5000/", "3", ["a1"])
    'http://127.0.0.1:5000/#/compare-runs?runs=%5B%22a1%22%5D&experiments=%5B%223%22%5D'
    """
    runs = quote(json.dumps(run_ids, separators=(",", ":")))
    exps = quote(json.dumps([experiment_id], separators=(",", ":")))
    return f"{base.rstrip('/')}/#/compare-runs?runs={runs}&experiments={exps}"
