"""Thin MLflow wrapper: one parent run per pipeline run, one child run per stage.

The store defaults to sqlite at ``<work_dir>/mlflow.db`` (absolute path) with artifacts in
``<work_dir>/mlartifacts``; ``mlflow.tracking_uri`` points elsewhere (e.g. a server).
Metric names are ``<group>/<metric>`` (``prepare/rows_rejected``, ``pack/fill``...);
params are the whole resolved config, flattened to dotted keys.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from schemas.config import PipelineConfig

PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"


def tracking_uri(cfg: PipelineConfig) -> str:
    if cfg.mlflow.tracking_uri:
        return cfg.mlflow.tracking_uri
    return f"sqlite:///{cfg.work_path / 'mlflow.db'}"


def experiment_name(cfg: PipelineConfig) -> str:
    return cfg.mlflow.experiment or cfg.name


def flatten_params(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten_params(v, key))
        else:
            out[key] = str(v)[:6000]
    return out


def _client(cfg: PipelineConfig):
    # Quiet MLflow's alembic migration chatter on a fresh store.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)

    cfg.work_path.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=tracking_uri(cfg))


def _experiment_id(client, cfg: PipelineConfig) -> str:
    from mlflow.exceptions import MlflowException

    name = experiment_name(cfg)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(
            name, artifact_location=(cfg.work_path / "mlartifacts").as_uri()
        )
    except MlflowException:  # created concurrently by another stage process
        return client.get_experiment_by_name(name).experiment_id


class Tracker:
    """One MLflow run. ``Tracker.disabled()`` logs nothing (``mlflow.enabled: false``)."""

    def __init__(self, client, run_id: str | None):
        self.client = client
        self.run_id = run_id

    @classmethod
    def disabled(cls) -> Tracker:
        return cls(None, None)

    @classmethod
    def start(
        cls,
        cfg: PipelineConfig,
        run_name: str,
        *,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> Tracker:
        if not cfg.mlflow.enabled or int(os.environ.get("RANK", "0")) != 0:
            return cls.disabled()  # under torchrun every rank runs the stage; rank 0 logs
        client = _client(cfg)
        all_tags = {RUN_NAME_TAG: run_name, "packline.pipeline": cfg.name, **(tags or {})}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        run = client.create_run(_experiment_id(client, cfg), run_name=run_name, tags=all_tags)
        tracker = cls(client, run.info.run_id)
        tracker.log_params(flatten_params(cfg.to_dict()))
        return tracker

    @property
    def enabled(self) -> bool:
        return self.run_id is not None

    def log_params(self, params: dict[str, str]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        if not self.enabled or not metrics:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_series(self, key: str, values: list[float], first_step: int) -> None:
        """``values`` of one metric at consecutive steps from ``first_step``, in one batch
        (e.g. ``pack/row_fill`` per row, its step being the row's index in the run)."""
        if not self.enabled or not values:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(v), now, first_step + i) for i, v in enumerate(values)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled:
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, v)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self.enabled and Path(path).exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self.client.set_terminated(self.run_id, status)
