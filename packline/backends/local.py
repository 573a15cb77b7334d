"""The ``local`` train backend: packline's own trainer (HF transformers + PEFT; on GPUs
varlen attention, bf16 and FSDP2, EP and PP across the node's ranks), started by torchrun
on this machine or in a SLURM job (``stages/train.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packline.backends import Backend, packline_packer
from schemas.choices import TrainBackend
from schemas.config import PipelineConfig
from schemas.rules import train_world

#: The local run's parallel layout, left out of its fingerprint: any layout resumes any
#: other's checkpoints (packline/train/checkpoint.py), so a run restarted on more or fewer
#: ranks, or split otherwise, continues where it stood instead of starting over.
LAYOUT_KEYS = ("nproc_per_node", "parallel")


class Local(Backend):
    def forecast_packer(self, cfg: PipelineConfig) -> dict[str, Any]:
        """packline's task encoder, as configured (:func:`packline_packer`)."""
        return packline_packer(cfg)

    def data_parallel_ranks(self, cfg: PipelineConfig) -> int:
        """The train run's ranks (every process of the SLURM train job, else
        ``train.nproc_per_node``) over ``train.parallel.pipeline_parallel`` (the stages of a
        pipeline read the same rows; EP splits no data)."""
        return max(train_world(cfg) // cfg.train.parallel.pipeline_parallel, 1)

    def train_settings(self, cfg: PipelineConfig) -> dict[str, Any]:
        """``model``, ``lora``, ``train`` (its layout aside: :data:`LAYOUT_KEYS`) and
        ``packing``."""
        d = cfg.to_dict()
        settings = {s: d[s] for s in ("model", "lora", "train", "packing")}
        settings["train"] = {k: v for k, v in settings["train"].items() if k not in LAYOUT_KEYS}
        return settings

    def export(self, cfg: PipelineConfig, to: Path, *, merge: bool) -> Path:
        """The PEFT adapter dir the train stage saved, copied; merged into the base with
        ``merge``."""
        from packline.serving.chat import require_adapter
        from packline.serving.export import copy_adapter, merge_adapter, publish_into

        adapter = require_adapter(cfg)
        if merge:
            return publish_into(to, lambda tmp: merge_adapter(cfg, adapter, tmp))
        return publish_into(to, lambda tmp: copy_adapter(adapter, tmp))


LOCAL = Local(
    name=TrainBackend.local,
    train_stage="stages.train:train",
    renders_for_bridge=False,
    trains_here=True,
    compares_packers=False,
)
