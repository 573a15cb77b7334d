"""The ``megatron`` train backend: Megatron-Bridge's finetune inside the NeMo container on
SLURM (``stages/train_megatron.py``), its data read from prepare's shards by packline's
dataset (``packing.packer: packline``) or Bridge's own (``bridge``); everything Bridge
itself is in ``packline/megatron/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packline.backends import Backend, packline_packer
from packline.megatron.overrides import RECIPE_MODULE, bridge_overrides, override_lines
from schemas.choices import Packer, TrainBackend
from schemas.config import PipelineConfig
from schemas.rules import train_nproc_per_node


class Megatron(Backend):
    def forecast_packer(self, cfg: PipelineConfig) -> dict[str, Any]:
        """packline's packer for Bridge (``packing.packer: packline``) selects as the local
        one does; Bridge's own (``bridge``) runs plain ``ffd`` without carry-over or FLOPs
        balance whatever the config says (validate refuses any other setting there)."""
        if cfg.packing.packer is Packer.bridge:
            return {"algorithm": "ffd", "max_carry_rounds": 0, "balance": False}
        return packline_packer(cfg)

    def data_parallel_ranks(self, cfg: PipelineConfig) -> int:
        """The SLURM train job's GPUs, ``nodes × (nproc_per_node or gpus_per_node)``, over
        TP × CP × PP (Bridge gives Energon the pure DP group; EP and sequence parallel
        split no data)."""
        job = cfg.executor.slurm.nodes * train_nproc_per_node(cfg)
        p, pp = cfg.packing, cfg.train.parallel.pipeline_parallel
        return max(job // (p.tensor_parallel * p.context_parallel * pp), 1)

    def train_settings(self, cfg: PipelineConfig) -> dict[str, Any]:
        """``model``, ``lora``, ``train``, ``packing`` and ``megatron``."""
        d = cfg.to_dict()
        return {s: d[s] for s in ("model", "lora", "train", "packing", "megatron")}

    def plan(self, cfg: PipelineConfig) -> list[str]:
        """The Bridge run the train job makes on every torchrun rank, as lines of text."""
        step = f"megatron.bridge.training.{cfg.megatron.step_func}.forward_step"
        return [
            "## train: Megatron-Bridge inside the container (stages/train_megatron.py), every rank",
            f"# recipe: {RECIPE_MODULE}.{cfg.megatron.recipe}(peft_scheme='lora')",
            f"# then: megatron.bridge.training.finetune.finetune(config, forward_step_func={step})",
            "# overrides, applied in this order (dotted ConfigContainer fields):",
            *override_lines(bridge_overrides(cfg)),
        ]

    def export(self, cfg: PipelineConfig, to: Path, *, merge: bool) -> Path | str:
        """Bridge's own adapter export of the latest checkpoint, in its container; outside
        it, the command that runs it there."""
        from packline.megatron.container import bridge_problem
        from packline.serving.export import bridge_export, bridge_export_command, publish_into

        if bridge_problem(packing=False) is not None:
            return bridge_export_command(cfg, to, merge=merge)
        return publish_into(to, lambda tmp: bridge_export(cfg, tmp, merge=merge))


MEGATRON = Megatron(
    name=TrainBackend.megatron,
    train_stage="stages.train_megatron:train_megatron",
    renders_for_bridge=True,
    trains_here=False,
    compares_packers=True,
)
