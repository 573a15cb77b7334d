"""The catalog: every artefact of a work dir, by name, in one place. A stage reads its
inputs and writes its outputs through it and hands the library paths, tables and values; no
other module spells another stage's file names (``tests/unit/test_layering.py`` holds the
short list of library modules that still ask it, each with its reason).

======================  ============================================================
``prepare.dataset``     :func:`dataset_dir`: shards, ``manifest.parquet``, rejects
``prepare.loader``      :func:`dataset_path`: what Energon loaders open
``prepare.manifest``    :func:`manifest_path`: every row's key, split and counts
``connect.processor``   :func:`processor_dir`: the processor dir every later stage loads
``connect.lengths``     :func:`lengths_path`: every sample's exact length and FLOPs
``connect.forecast``    :func:`forecast_path`: the packing forecast (``forecast.json``)
``connect.bridge``      :func:`bridge_videos_path`: Bridge's view of the videos
``<stage>.record``      :func:`record_path`: a stage's completion record
``validate.config``     :func:`validated_config_path`: the config validate checked
``train.run(mode)``     :func:`train_run_dir`: one local run (``packed``/``unpacked``)
``train.adapter``       :func:`adapter_dir`: the PEFT adapter a local run saved
``export(merge)``       :func:`export_dir`: ``packline export``'s default target
======================  ============================================================

    >>> from schemas.config import load_config
    >>> cfg = load_config(None, ["work_dir=/w"])
    >>> [str(artefact(cfg, name)) for name in ("connect.lengths", "train.adapter")]
    ['/w/connect/lengths.parquet', '/w/train/packed/adapter']
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packline.energon.files import PACKLINE_METADATASET
from schemas.config import PipelineConfig, SourceKind

RECORD_NAME = "_COMPLETE.json"
"""A stage's completion record (written last: its presence means the outputs are whole)."""
PROCESSOR = "processor"
"""connect's processor dir, inside its stage dir."""
BRIDGE_VIDEOS = "bridge_videos.json"
"""connect's report of what Megatron-Bridge's encoder makes of the videos (backend
megatron), inside its stage dir; validate reads it."""


def stage_path(work: Path, stage: str) -> Path:
    """``<work>/<stage>``: where ``stage`` publishes its outputs and its record, in the work
    dir ``work`` (a stage's bookkeeping needs no more of the config than that)."""
    return Path(work) / stage


def stage_dir(cfg: PipelineConfig, stage: str) -> Path:
    """:func:`stage_path` in ``cfg``'s work dir."""
    return stage_path(cfg.work_path, stage)


def dataset_dir(cfg: PipelineConfig) -> Path:
    """prepare's output dir: ``manifest.parquet``, ``rejects.jsonl``, Bridge's ``bridge.yaml``
    view and, unless the source is an Energon dataset adopted in place, the shards."""
    return stage_dir(cfg, "prepare")


def dataset_path(cfg: PipelineConfig) -> Path:
    """What packline's Energon loaders open: prepare's dir, or for an Energon dataset
    adopted in place (``data.source`` names one), the metadataset over it that prepare
    wrote (:data:`PACKLINE_METADATASET`)."""
    if cfg.data.kind is SourceKind.energon:
        return dataset_dir(cfg) / PACKLINE_METADATASET
    return dataset_dir(cfg)


def manifest_path(cfg: PipelineConfig) -> Path:
    """prepare's ``manifest.parquet``: every accepted row's key, split and counts."""
    return dataset_dir(cfg) / "manifest.parquet"


def processor_dir(cfg: PipelineConfig) -> Path:
    """The processor dir connect measured the lengths with; every later stage loads it."""
    return stage_dir(cfg, "connect") / PROCESSOR


def lengths_path(cfg: PipelineConfig) -> Path:
    """connect's ``lengths.parquet``: every sample's exact length and FLOPs, by key."""
    return stage_dir(cfg, "connect") / "lengths.parquet"


#: connect's forecast, in its stage dir.
FORECAST_FILE = "forecast.json"


def forecast_path(cfg: PipelineConfig) -> Path:
    """connect's ``forecast.json`` (:func:`packline.forecast.config_forecast`)."""
    return stage_dir(cfg, "connect") / FORECAST_FILE


def read_forecast(cfg: PipelineConfig) -> dict[str, Any]:
    """connect's forecast, or ``{}`` before connect."""
    path = forecast_path(cfg)
    return json.loads(path.read_text()) if path.is_file() else {}


def bridge_videos_path(cfg: PipelineConfig) -> Path:
    """connect's report of Bridge's view of the videos (:data:`BRIDGE_VIDEOS`)."""
    return stage_dir(cfg, "connect") / BRIDGE_VIDEOS


#: The resolved config validate checked, in its stage dir (what a megatron run trains with).
VALIDATED_CONFIG = "pipeline.yaml"


def validated_config_path(cfg: PipelineConfig) -> Path:
    """The resolved config the validate stage checked (:data:`VALIDATED_CONFIG`)."""
    return stage_dir(cfg, "validate") / VALIDATED_CONFIG


def train_run_dir(cfg: PipelineConfig, packed: bool = True) -> Path:
    """``<work>/train/packed`` or ``<work>/train/unpacked``: one local training run's dir
    (checkpoints, ``adapter/``, its resolved ``config.yaml``, ``result.json``)."""
    return stage_dir(cfg, "train") / ("packed" if packed else "unpacked")


def adapter_dir(cfg: PipelineConfig, packed: bool | None = None) -> Path:
    """The PEFT adapter a local training run saved (``adapter_config.json`` and the
    ``adapter_model.safetensors``): what ``packline chat`` and ``packline export`` load.
    By default the run of the config's own packing setting (``packing.enabled``)."""
    return train_run_dir(cfg, cfg.packing.enabled if packed is None else packed) / "adapter"


def export_dir(cfg: PipelineConfig, merge: bool) -> Path:
    """Where ``packline export`` writes without ``--to``: ``<work>/export/merged`` (a merged
    HF checkpoint) or ``<work>/export/adapter``."""
    return cfg.work_path / "export" / ("merged" if merge else "adapter")


def record_path(work: Path, stage: str) -> Path:
    """``stage``'s completion record in the work dir ``work`` (written last: its presence
    means the outputs are whole)."""
    return stage_path(work, stage) / RECORD_NAME


def read_record(work: Path, stage: str) -> dict[str, Any] | None:
    """The completion record of ``stage`` in the work dir ``work``, or None when it has not
    completed."""
    path = record_path(work, stage)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


#: Every artefact by its name (the table above).
ARTEFACTS: dict[str, Callable[[PipelineConfig], Path]] = {
    "prepare.dataset": dataset_dir,
    "prepare.loader": dataset_path,
    "prepare.manifest": manifest_path,
    "connect.processor": processor_dir,
    "connect.lengths": lengths_path,
    "connect.forecast": forecast_path,
    "connect.bridge": bridge_videos_path,
    "validate.config": validated_config_path,
    "train.adapter": adapter_dir,
}


def artefact(cfg: PipelineConfig, name: str) -> Path:
    """The artefact ``name`` of :data:`ARTEFACTS` in ``cfg``'s work dir."""
    return ARTEFACTS[name](cfg)
