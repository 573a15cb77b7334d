"""Thin MLflow wrapper: one parent run per pipeline run, one child run per stage.

The store defaults to sqlite at ``<work_dir>/mlflow.db`` (absolute path) with artifacts in
``<work_dir>/mlartifacts``; ``mlflow.tracking_uri`` points elsewhere (e.g. a server).
Metric names are ``<group>/<metric>`` (``prepare/rows_rejected``, ``pack/fill``...);
params are the whole resolved config, flattened to dotted keys.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
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


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` URI, else None.

    >>> sqlite_path("sqlite:///runs/x/mlflow.db"), sqlite_path("http://host:5000")
    (PosixPath('runs/x/mlflow.db'), None)
    """
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


ARTIFACTS = "mlartifacts"
"""The default store's artifact root, inside the work dir."""


def artifact_root(cfg: PipelineConfig) -> str:
    """``<work_dir>/mlartifacts`` as the file URI MLflow records for the default store."""
    return (cfg.work_path / ARTIFACTS).as_uri()


def check_store(db: Path) -> None:
    """Refuse (``UserError``, exit 2) a sqlite store that is not a whole sqlite database —
    a file cut short, overwritten, or a copy taken mid-write — naming it and the fix, before
    MLflow opens it (MLflow would print a sqlite traceback, or try to migrate it). The file
    is opened read-only (``mode=ro``) and never changed. Every packline command that opens
    the store comes here first (:func:`relocate_artifacts`)."""
    from schemas.errors import UserError

    uri = f"{db.resolve().as_uri()}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=60)) as con:
            verdict = con.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.OperationalError:
        return  # locked by a writer, or not openable: not damage (MLflow says what it is)
    except sqlite3.DatabaseError as exc:  # not a database, or a malformed one
        verdict = str(exc)
    if verdict == "ok":
        return
    raise UserError(
        [
            f"{db} is not a readable MLflow store (sqlite says: {verdict}); fix: move it aside "
            f"to start a new one (mv {db} {db}.broken; the next run logs to a new store, the "
            f"artifacts in {db.parent / ARTIFACTS} stay), or restore it from a backup"
        ],
        "the MLflow store is damaged",
    )


def relocate_artifacts(cfg: PipelineConfig) -> int:
    """Point the default store's recorded artifact locations at this work dir; returns how
    many experiments moved (0 when they already point here, or the store is not packline's
    default sqlite one).

    MLflow records every artifact location as an absolute URI (local paths are resolved when
    an experiment is created), so a work dir copied or moved elsewhere would still name the
    old place: runs, the UI and ``packline compare`` would read the old artifacts, or none.
    MLflow has no call to change a recorded location, so this rewrites the two columns that
    hold them (``experiments.artifact_location``, ``runs.artifact_uri``) in one transaction,
    for experiments whose location is some work dir's ``mlartifacts``.
    """
    db = sqlite_path(tracking_uri(cfg))
    if db is None or not db.is_file():
        return 0
    check_store(db)  # any sqlite store, the default one or a tracking_uri's
    if cfg.mlflow.tracking_uri:
        return 0  # not packline's default store: its locations are the user's
    new = artifact_root(cfg)
    with contextlib.closing(sqlite3.connect(db, timeout=60)) as con, con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"experiments", "runs"} <= tables:
            return 0  # a store MLflow has not set up yet
        old_roots = {
            loc
            for (loc,) in con.execute("SELECT DISTINCT artifact_location FROM experiments")
            if loc and loc != new and loc.rstrip("/").endswith(f"/{ARTIFACTS}")
        }
        for old in old_roots:
            con.execute(
                "UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?",
                (new, old),
            )
            con.execute(
                "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                "WHERE substr(artifact_uri, 1, ?) = ?",
                (new, len(old) + 1, len(old) + 1, old + "/"),
            )
    return len(old_roots)


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
    relocate_artifacts(cfg)  # a work dir copied or moved: log where it is now
    return MlflowClient(tracking_uri=tracking_uri(cfg))


def _experiment_id(client, cfg: PipelineConfig) -> str:
    from mlflow.exceptions import MlflowException

    name = experiment_name(cfg)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_root(cfg))
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

    def end_failed(self) -> None:
        """End the run as FAILED on the way out of a failure: a store that cannot take it
        now (the device that filled, a read-only mount) must not replace the error that
        failed the stage; it is said in a warning instead."""
        try:
            self.end("FAILED")
        except Exception as exc:  # noqa: BLE001 - the stage's own error goes on
            from packline.progress import console

            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            console.log(f"[yellow]warning:[/] the MLflow run could not be marked failed: {first}")
