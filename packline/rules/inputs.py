"""What validate's data and model rules read: prepare's manifest, connect's lengths and
processor, what connect found of Bridge's videos, and the model's config (a model built on
the meta device from it when a rule needs one)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from packline.qwen.model import build_meta_model
from packline.qwen.processor import load_processor
from packline.train.setup import model_config
from schemas.config import (
    PipelineConfig,
)

GIB = 1024**3
MIB = 1024**2
#: model_type of the HF configs packline trains
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass
class Inputs:
    """What the data and model rules read; rules add the figures they compute to ``facts``."""

    cfg: PipelineConfig
    manifest: pd.DataFrame
    lengths: pd.DataFrame
    processor: Any
    connect_current: bool
    alignment: int
    """The multiple each conversation is padded to, as the run pads it (for the Megatron
    backend: Bridge's, with the eval CP size and the SP its MoE provider turns on)."""
    model_config: Any = None
    model_config_problem: str | None = None
    bridge_videos: dict[str, Any] | None = None
    """connect's ``bridge_videos.json`` (backend megatron with videos): what Bridge's encoder
    makes of them."""
    connect_dir: Path | None = None
    """connect's stage dir (a rule's message names it)."""
    processor_dir: Path | None = None
    """connect's processor dir (a rule's message names it)."""
    facts: dict[str, Any] = field(default_factory=dict)
    _model: torch.nn.Module | None = None

    @property
    def model(self) -> torch.nn.Module:
        """The configured model on the meta device (built once, from its config only)."""
        if self._model is None:
            self._model = build_meta_model(self.model_config)
        return self._model

    @property
    def model_ok(self) -> bool:
        return self.model_config is not None and self.model_config_problem is None


@dataclass(frozen=True)
class Upstream:
    """What validate reads of the stages before it: the validate stage hands it over from
    the catalog (``stages/validate.py``), so no rule knows where a stage keeps its files."""

    manifest: Path
    """prepare's ``manifest.parquet``."""
    lengths: Path
    """connect's lengths table."""
    processor_dir: Path
    """connect's processor dir."""
    connect_dir: Path
    """connect's stage dir."""
    bridge_videos: Path
    """connect's report of Bridge's view of the videos (present with backend megatron and
    videos)."""
    connect_current: bool
    """connect's completion record holds these very settings."""


def load_inputs(cfg: PipelineConfig, upstream: Upstream, alignment: int | None = None) -> Inputs:
    """Read prepare's manifest, connect's lengths and processor (``upstream``), and the
    model's config. ``alignment`` defaults to ``packing.alignment``."""
    processor = load_processor(upstream.processor_dir)
    inputs = Inputs(
        cfg=cfg,
        manifest=pd.read_parquet(upstream.manifest),
        lengths=pd.read_parquet(upstream.lengths),
        processor=processor,
        connect_current=upstream.connect_current,
        alignment=cfg.packing.alignment if alignment is None else alignment,
        connect_dir=upstream.connect_dir,
        processor_dir=upstream.processor_dir,
    )
    if upstream.bridge_videos.is_file():
        inputs.bridge_videos = json.loads(upstream.bridge_videos.read_text())
    model_dir = cfg.model.dir  # a dir, or a Hub repo's cached snapshot
    if cfg.model.path and model_dir is None:
        inputs.model_config_problem = "a Hub repo the local Hugging Face cache lacks"
    elif model_dir is not None and not model_dir.is_dir():
        inputs.model_config_problem = "not a directory"
    elif model_dir is not None and not (model_dir / "config.json").is_file():
        inputs.model_config_problem = "it holds no config.json"
    if inputs.model_config_problem:
        return inputs
    try:
        inputs.model_config = model_config(cfg, processor)
    except (OSError, ValueError, KeyError) as exc:
        inputs.model_config_problem = str(exc).strip().splitlines()[0]
    else:
        model_type = getattr(inputs.model_config, "model_type", None)
        if model_type not in QWEN3_VL_TYPES:
            inputs.model_config_problem = (
                f"its config.json is a {model_type!r} model, not Qwen3-VL "
                f"({' or '.join(QWEN3_VL_TYPES)})"
            )
    return inputs
