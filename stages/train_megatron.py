"""Stage train, backend ``megatron``: a Megatron-Bridge LoRA finetune inside the NeMo container.

Runs on every torchrun rank of the SLURM train job (one process per GPU). ``megatron.bridge``
is imported only inside :func:`train_megatron`: this module can be imported anywhere, the
Bridge run happens only in the container. What it runs:

1. the recipe ``megatron.recipe`` from ``megatron.bridge.recipes.qwen_vl`` (LoRA); a recipe whose
   dataset is not Energon (the MoE ones) gets an ``EnergonDatasetConfig`` first;
2. packline's overrides (``stages/megatron_overrides.py``), every key checked to be a field;
3. ``finetune`` with the ``megatron.step_func`` forward step.

Bridge logs to packline's MLflow store on its last rank; afterwards rank 0 nests that run under
the train stage's run and writes the completion record. Outputs in ``<work>/train/megatron/``:
``checkpoints/`` (Bridge's, resumed on a rerun) and ``overrides.json``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from typing import Any

from schemas.config import ConfigError, PipelineConfig
from stages.base import StageResult, write_record
from stages.megatron_overrides import (
    RECIPE_MODULE,
    apply_overrides,
    bridge_overrides,
    megatron_problems,
    section_classes,
)

STAGE = "train"
LAUNCH_TAG = "packline.launch_id"


def _bridge_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        return False


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
        raise ConfigError(
            [
                f"megatron.recipe {cfg.megatron.recipe!r} is not in {RECIPE_MODULE}: "
                f"{', '.join(known)}"
            ]
        )
    container = recipe_fn(peft_scheme="lora")
    if not isinstance(container.dataset, EnergonDatasetConfig):
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
            raise ConfigError(
                [
                    f"recipe {cfg.megatron.recipe!r}: {prefix} is "
                    f"{type(node).__name__}, packline's overrides are for {qualified}"
                ]
            )
    apply_overrides(container, overrides)
    if cfg.packing.enabled:
        _require_native_packing()
    return container


def _require_native_packing() -> None:
    """Bridge releases before NVIDIA-NeMo/Megatron-Bridge#5285 accept ``packing_buffer_size``
    but their Qwen-VL encoder cannot pack: refuse instead of training unpacked."""
    from megatron.bridge.models.qwen_vl.data.energon import QwenVLTaskEncoder

    if "select_samples_to_pack" not in vars(QwenVLTaskEncoder):
        raise RuntimeError(
            "this container's Megatron-Bridge has no native Energon packing for Qwen-VL "
            "(Megatron-Bridge PR #5285); use an image that includes it, or packing.enabled=false"
        )


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
    cfg: PipelineConfig, fp: str, *, parent_run_id: str | None = None
) -> StageResult:
    """Run the Bridge finetune on this rank; rank 0 records the stage."""
    t0 = time.perf_counter()
    problems = megatron_problems(cfg, world_size=_world_size())
    if problems:
        raise ConfigError(problems, "train.backend megatron cannot run this config")
    if not _bridge_importable():
        raise ConfigError(
            [
                "train.backend megatron needs megatron.bridge, which is installed only in the "
                "cluster's NeMo container: run with --executor slurm and "
                "executor.slurm.container_image"
            ],
            "train.backend megatron cannot run here",
        )
    rank = int(os.environ.get("RANK", "0"))
    # The same on every rank of this launch, so rank 0 can find the run Bridge's last rank made.
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID", "local")
    overrides = bridge_overrides(cfg, mlflow_tags={LAUNCH_TAG: launch_id})
    container = build_bridge_config(cfg, overrides)
    step = importlib.import_module(f"megatron.bridge.training.{cfg.megatron.step_func}")
    from megatron.bridge.training.finetune import finetune

    finetune(container, forward_step_func=step.forward_step)
    out = cfg.work_path / STAGE / "megatron"
    result = StageResult(
        stage=STAGE,
        out_dir=cfg.work_path / STAGE,
        fingerprint=fp,
        skipped=False,
        metrics={},
        summary={"recipe": cfg.megatron.recipe, "launch_id": launch_id},
        seconds=time.perf_counter() - t0,
    )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "overrides.json").write_text(json.dumps(overrides, indent=2, default=str))
        result.metrics = _nest_bridge_run(cfg, launch_id, parent_run_id)
        result.summary["artifacts"] = [str(out / "overrides.json")]
        write_record(cfg, result)
    return result
