"""Stage train, backend ``megatron``: a Megatron-Bridge LoRA finetune inside the NeMo container.

Runs on every torchrun rank of the SLURM train job (one process per GPU). ``megatron.bridge``
is imported only inside :func:`train_megatron`: this module can be imported anywhere, the
Bridge run happens only in the container. What it runs:

1. the recipe ``megatron.recipe`` from ``megatron.bridge.recipes.qwen_vl`` (LoRA), its dataset
   replaced by packline's (:func:`packline.megatron.dataset.bridge_dataset`: lazy lengths,
   packline's selection, carry-over) with ``packing.packer: packline``; otherwise a recipe
   whose dataset is not Energon (the MoE ones) gets Bridge's ``EnergonDatasetConfig``;
2. packline's overrides (``packline/megatron/overrides.py``), every key checked to be a field;
3. ``finetune`` with the ``megatron.step_func`` forward step.

Bridge logs to packline's MLflow store on its last rank; afterwards rank 0 nests that run under
the train stage's run and writes the completion record, whose metrics (logged on the stage's
run) also carry the packs' figures from connect's forecast for this packer
(``packing/forecast_fill``, ``_padding_share``, ``_straggler_ratio``, ``_rows``). Outputs in
``<work>/train/megatron/``: ``checkpoints/`` (Bridge's, resumed on a rerun) and ``overrides.json``.

Which Bridge: no release packs natively. ``nvcr.io/nvidia/nemo:26.06`` carries 0.5.0, which
has no ``megatron.bridge.data.builders.energon``; 0.6.x has no
``QwenVLTaskEncoder.select_samples_to_pack``. Native Energon packing for Qwen-VL is on main from
:data:`~packline.megatron.container.NATIVE_PACKING_COMMIT` (#5285); ``containers/Dockerfile``
builds :data:`~packline.megatron.container.PACKLINE_IMAGE` with its ``BRIDGE_COMMIT``.
:func:`~packline.megatron.container.bridge_problem` reads the installed Bridge's source (it
imports nothing of it) and the job stops with that fix before any Bridge import.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from typing import Any

from packline.catalog import read_forecast
from packline.fingerprints import stage_fingerprint
from packline.megatron.container import bridge_problem
from packline.megatron.overrides import (
    RECIPE_MODULE,
    apply_overrides,
    bridge_overrides,
    packs_with_packline,
    section_classes,
)
from packline.packing.forecast import packing_metrics
from packline.rules.megatron import megatron_problems
from schemas.config import PipelineConfig
from schemas.errors import UserError
from stages.base import StageResult, require_current, stage_dir, stage_result, write_record

STAGE = "train"
LAUNCH_TAG = "packline.launch_id"


def _import_class(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_bridge_config(cfg: PipelineConfig, overrides: dict[str, Any]) -> Any:
    """The recipe's ConfigContainer with packline's overrides applied (needs megatron.bridge)."""
    from megatron.bridge.data.builders.energon import (
        EnergonDatasetConfig,
        QwenVLEnergonTaskEncoderConfig,
    )

    recipes = importlib.import_module(RECIPE_MODULE)
    recipe_fn = getattr(recipes, cfg.megatron.recipe, None)
    if recipe_fn is None:
        known = sorted(n for n in dir(recipes) if n.endswith("_config"))
        raise UserError(
            [
                f"megatron.recipe {cfg.megatron.recipe!r} is not in {RECIPE_MODULE}: "
                f"{', '.join(known)}"
            ]
        )
    container = recipe_fn(peft_scheme="lora")
    if packs_with_packline(cfg):
        from packline.megatron.dataset import bridge_dataset

        container.dataset = bridge_dataset(cfg)
    elif not isinstance(container.dataset, EnergonDatasetConfig):
        container.dataset = EnergonDatasetConfig(
            path=overrides["dataset.path"],
            seq_length=overrides["dataset.seq_length"],
            micro_batch_size=1,
            task_encoder=QwenVLEnergonTaskEncoderConfig(
                hf_processor_path=overrides["dataset.task_encoder.hf_processor_path"]
            ),
        )
    for prefix, qualified in section_classes(cfg).items():
        node = container
        for part in prefix.split("."):
            node = getattr(node, part)
        if not isinstance(node, _import_class(qualified)):
            raise UserError(
                [
                    f"recipe {cfg.megatron.recipe!r}: {prefix} is "
                    f"{type(node).__name__}, packline's overrides are for {qualified}"
                ]
            )
    apply_overrides(container, overrides)
    return container


def _nest_bridge_run(cfg: PipelineConfig, launch_id: str, parent_run_id: str | None) -> dict:
    """Put Bridge's MLflow run under the stage's run; return its latest metrics."""
    if not (cfg.mlflow.enabled and parent_run_id):
        return {}
    from mlflow.tracking import MlflowClient

    from packline.tracking import PARENT_TAG, experiment_name, tracking_uri

    client = MlflowClient(tracking_uri=tracking_uri(cfg))
    exp = client.get_experiment_by_name(experiment_name(cfg))
    if exp is None:
        return {}
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{LAUNCH_TAG}` = '{launch_id}'"
    )
    metrics: dict[str, float] = {}
    for run in runs:
        client.set_tag(run.info.run_id, PARENT_TAG, parent_run_id)
        metrics.update({f"megatron/{k}": v for k, v in run.data.metrics.items()})
    return metrics


def train_megatron(
    cfg: PipelineConfig, fp: str | None = None, *, parent_run_id: str | None = None
) -> StageResult:
    """Run the Bridge finetune on this rank; rank 0 records the stage. The runner has made
    sure validate passed these settings first."""
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    problems = megatron_problems(cfg, world_size=_world_size())
    if problems:
        raise UserError(problems, "train.backend megatron cannot run this config")
    problem = bridge_problem(packing=cfg.packing.enabled)
    if problem:  # before any Bridge import: an old Bridge would crash on it or train unpacked
        raise UserError([problem], "train.backend megatron cannot run here")
    require_current(cfg, "validate", by="train")
    rank = int(os.environ.get("RANK", "0"))
    # The same on every rank of this launch, so rank 0 can find the run Bridge's last rank made.
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID", "local")
    overrides = bridge_overrides(cfg, mlflow_tags={LAUNCH_TAG: launch_id})
    container = build_bridge_config(cfg, overrides)
    step = importlib.import_module(f"megatron.bridge.training.{cfg.megatron.step_func}")
    from megatron.bridge.training.finetune import finetune

    finetune(container, forward_step_func=step.forward_step)
    out = stage_dir(cfg, STAGE) / "megatron"
    result = stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics={},
        summary={"recipe": cfg.megatron.recipe, "launch_id": launch_id},
        t0=t0,
    )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "overrides.json").write_text(json.dumps(overrides, indent=2, default=str))
        # the packs the run trained on, as connect forecast them for this config's packer
        result.metrics = {
            **packing_metrics(read_forecast(cfg)),
            **_nest_bridge_run(cfg, launch_id, parent_run_id),
        }
        result.summary["artifacts"] = [str(out / "overrides.json")]
        write_record(result)
    return result
