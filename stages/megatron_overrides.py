"""The packline config as a Megatron-Bridge run: recipe name + dotted ConfigContainer overrides,
and the Megatron rules that run must keep.

Pure: this module never imports ``megatron.bridge`` (it cannot be installed off the cluster), so
the overrides can be printed by ``--dryrun``, checked by the validate stage and tested here. The
in-container side (``stages/train_megatron.py``) applies them to the recipe's ConfigContainer.

Groups (each key is a field of a Bridge/Megatron-Core config dataclass; the test suite checks
every key against a pinned Bridge release's source):

- data: the prepared Energon dataset, the processor connect measured lengths with, and native
  Energon packing through ``dataset.packing_buffer_size`` (samples per loader worker).
- packing requirements (Bridge's native-packing guardrails): micro-batch 1 in all three places
  (train, dataset, ``validation.eval_micro_batch_size``), per-token loss
  (``model.calculate_per_token_loss``), gradient sums not averaged in the collective
  (``ddp.average_in_collective=False``), no pipeline parallelism, no CUDA graphs.
- MoE (``model.moe``): EP from ``megatron.expert_parallel``, expert TP 1, no MTP, the
  ``alltoall`` dispatcher, EP communication overlap and delayed wgrad off; EP > 1 packs
  fixed-width rows (``dataset.pad_to_max_length``); sequence parallelism on with TP > 1, as
  Bridge's MoE provider turns it on anyway.
- schedule: AdamW with ``train.weight_decay`` in the optimizer *and* the scheduler's
  ``start_weight_decay``/``end_weight_decay`` (the scheduler writes every param group's decay
  each step from those: the recipes' 0.033 would otherwise decay the adapters).
- LoRA, checkpoints (resume from ``<work>/train/megatron/checkpoints``), and Bridge's own MLflow
  logger pointed at packline's store and experiment.

``megatron.extra_overrides`` are applied last, so they win. The Megatron rules
(:data:`MEGATRON_RULES`, run by the validate stage, by ``packline run --executor slurm`` and by
the in-container entry) therefore read the overrides Bridge will really get: every extra key
must name a field of Bridge's config (the table in :mod:`stages.bridge_fields`, generated from
the pinned release's source) and keep Bridge's guardrails.
"""

from __future__ import annotations

import json
from typing import Any

from packline.tracking import experiment_name, tracking_uri
from schemas.config import ConfigError, PipelineConfig
from stages.prepare import BRIDGE_METADATASET, image_geometry

#: packline's HF module names → Megatron module names (Bridge LoRA ``target_modules``).
#: Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``: naming one of a
#: fused group adapts the whole group. MoE expert parameters map to the experts' linears.
LORA_TARGETS = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
    "mlp.experts.gate_up_proj": "linear_fc1",
    "mlp.experts.down_proj": "linear_fc2",
}

#: The concrete Bridge classes behind the ConfigContainer's union-typed sections for the runs
#: packline builds (the other sections have one declared type on ConfigContainer).
DATASET_CLASS = "megatron.bridge.data.builders.energon.EnergonDatasetConfig"
TASK_ENCODER_CLASS = "megatron.bridge.data.builders.energon.QwenVLEnergonTaskEncoderConfig"
LORA_CLASS = "megatron.bridge.peft.lora.LoRA"
DENSE_MODEL_CLASS = "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLModelProvider"
MOE_MODEL_CLASS = "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLMoEModelProvider"
RECIPE_MODULE = "megatron.bridge.recipes.qwen_vl"


def section_classes(cfg: PipelineConfig) -> dict[str, str]:
    """Dotted prefix → qualified class name of the concrete config object there."""
    return {
        "model": MOE_MODEL_CLASS if cfg.model.moe else DENSE_MODEL_CLASS,
        "dataset": DATASET_CLASS,
        "dataset.task_encoder": TASK_ENCODER_CLASS,
        "peft": LORA_CLASS,
    }


def lora_target_problems(cfg: PipelineConfig) -> list[str]:
    """One line per ``lora.target_modules`` / ``target_parameters`` entry with no Megatron
    module."""
    names = list(cfg.lora.target_modules) + list(cfg.lora.target_parameters)
    return [
        f"lora target {n!r} has no Megatron-Bridge module (train.backend megatron knows: "
        f"{', '.join(LORA_TARGETS)})"
        for n in names
        if n not in LORA_TARGETS
    ]


def _mapped_targets(cfg: PipelineConfig) -> list[str]:
    names = list(cfg.lora.target_modules) + list(cfg.lora.target_parameters)
    return list(dict.fromkeys(LORA_TARGETS[n] for n in names if n in LORA_TARGETS))


def lora_target_modules(cfg: PipelineConfig) -> list[str]:
    """Bridge LoRA target modules for packline's ``lora.target_modules`` + ``target_parameters``
    (order kept, duplicates dropped). Raises ConfigError naming every unmappable target."""
    problems = lora_target_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return _mapped_targets(cfg)


def sequence_parallel(cfg: PipelineConfig) -> bool:
    """Sequence parallelism as the run has it: ``packing.sequence_parallel``, and always with
    TP > 1 on an MoE model — Bridge's ``Qwen3VLMoEModelProvider.finalize`` turns it on there,
    after ``ConfigContainer.validate`` has computed the alignment without it."""
    p = cfg.packing
    return p.sequence_parallel or (cfg.model.moe and p.tensor_parallel > 1)


def _geometry_overrides(cfg: PipelineConfig) -> dict[str, int]:
    g = image_geometry(cfg)
    return {
        "dataset.task_encoder.min_pixels": g.min_pixels,
        "dataset.task_encoder.max_pixels": g.max_pixels,
        "dataset.task_encoder.patch_size": g.patch_size,
        "dataset.task_encoder.temporal_patch_size": g.temporal_patch_size,
        "dataset.task_encoder.spatial_merge_size": g.merge_size,
    }


def checkpoint_dir(cfg: PipelineConfig) -> str:
    return str(cfg.work_path / "train" / "megatron" / "checkpoints")


def bridge_overrides(
    cfg: PipelineConfig, *, mlflow_tags: dict[str, str] | None = None
) -> dict[str, Any]:
    """Every ConfigContainer field packline sets, as ``{"dotted.key": value}`` in apply order:
    packline's own, then ``megatron.extra_overrides`` (which win).

    ``mlflow_tags`` are added to packline's own tags on Bridge's MLflow run (the train stage
    passes the run it nests under). Raises ConfigError for LoRA targets with no Megatron name."""
    o = _packline_overrides(cfg, lora_target_modules(cfg), mlflow_tags)
    o.update(extra_overrides(cfg))
    return o


def extra_overrides(cfg: PipelineConfig) -> dict[str, Any]:
    """``megatron.extra_overrides`` as ``{"dotted.key": value}`` (values parsed as JSON)."""
    out: dict[str, Any] = {}
    for item in cfg.megatron.extra_overrides:
        key, _, raw = item.partition("=")
        out[key.strip()] = _parse_value(raw)
    return out


def _packline_overrides(
    cfg: PipelineConfig, lora_targets: list[str], mlflow_tags: dict[str, str] | None
) -> dict[str, Any]:
    """The overrides packline's own settings make (no extra overrides)."""
    p, t, m = cfg.packing, cfg.train, cfg.megatron
    ep = m.expert_parallel
    work = cfg.work_path
    o: dict[str, Any] = {
        # data: the prepared Energon dataset and the processor connect measured lengths with
        "dataset.path": str(work / "prepare" / BRIDGE_METADATASET),
        "dataset.seq_length": p.seq_length,
        "dataset.num_workers": t.num_workers,
        "dataset.packing_buffer_size": p.packing_buffer_size if p.enabled else None,
        "dataset.pad_to_max_length": p.pad_to_max_length or ep > 1,
        "dataset.task_encoder.hf_processor_path": str(work / "connect" / "processor"),
        "dataset.task_encoder.max_num_images": m.max_num_images,
        "dataset.task_encoder.max_visual_tokens": m.max_visual_tokens,
        # the visual geometry connect measured with (Bridge's defaults — min 200,704 and max
        # 1,003,520 pixels, patch 14 — would change every image's token count)
        **_geometry_overrides(cfg),
        "model.seq_length": p.seq_length,
        # packing requirements: one pack per micro-batch, loss normalized over tokens
        "dataset.micro_batch_size": 1,
        "train.micro_batch_size": 1,
        # the settings validate checks (megatron.*): what packing needs, or it stops there
        "model.calculate_per_token_loss": m.calculate_per_token_loss,
        "ddp.average_in_collective": m.average_in_collective,
        "model.pipeline_model_parallel_size": m.pipeline_parallel,
        "model.cuda_graph_impl": m.cuda_graph_impl.value,
        "model.vision_cuda_graph_impl": m.vision_cuda_graph_impl.value,
        # parallelism (alignment of each conversation follows TP/CP/SP, see packing.alignment)
        "model.tensor_model_parallel_size": p.tensor_parallel,
        "model.context_parallel_size": p.context_parallel,
        "model.sequence_parallel": sequence_parallel(cfg),
    }
    if cfg.model.moe:
        o.update(
            {
                "model.expert_model_parallel_size": ep,
                "model.expert_tensor_parallel_size": 1,
                "model.mtp_num_layers": m.mtp_num_layers,
                "model.moe_token_dispatcher_type": "alltoall",
                "model.overlap_moe_expert_parallel_comm": m.overlap_moe_expert_parallel_comm,
                "model.delay_wgrad_compute": m.delay_wgrad_compute,
            }
        )
    o.update(
        {
            # schedule: AdamW, linear warmup then cosine to 0 (as the local backend)
            "train.global_batch_size": t.global_batch_size,
            "train.train_iters": t.max_steps,
            "optimizer.lr": t.lr,
            "optimizer.min_lr": 0.0,
            "optimizer.weight_decay": t.weight_decay,
            "optimizer.clip_grad": t.grad_clip,
            "scheduler.lr_warmup_iters": t.warmup_steps,
            "scheduler.lr_decay_iters": t.max_steps,
            "scheduler.lr_decay_style": "cosine",
            # the scheduler sets every param group's weight_decay each step from these (the
            # recipes set 0.033): optimizer.weight_decay alone would change nothing
            "scheduler.start_weight_decay": t.weight_decay,
            "scheduler.end_weight_decay": t.weight_decay,
            "rng.seed": t.seed,
            "validation.eval_interval": t.eval_every or t.max_steps,
            # Bridge requires the eval micro-batch to equal the dataset's (one packed row)
            "validation.eval_micro_batch_size": 1,
            # LoRA on the language model
            "peft.dim": cfg.lora.rank,
            "peft.alpha": cfg.lora.alpha,
            "peft.dropout": cfg.lora.dropout,
            "peft.target_modules": lora_targets,
            # checkpoints: base weights from the HF dir, resume from packline's work dir
            "checkpoint.pretrained_checkpoint": cfg.model.path,
            "checkpoint.save": checkpoint_dir(cfg),
            "checkpoint.load": checkpoint_dir(cfg),
            "checkpoint.save_interval": t.save_every,
            "checkpoint.most_recent_k": t.keep_last,
            "logger.log_interval": 1,
        }
    )
    if cfg.mlflow.enabled:
        tags = {"packline.pipeline": cfg.name, "packline.stage": "train", **(mlflow_tags or {})}
        o.update(
            {
                "logger.mlflow_experiment": experiment_name(cfg),
                "logger.mlflow_run_name": cfg.megatron.run_name,
                "logger.mlflow_tracking_uri": tracking_uri(cfg),
                "logger.mlflow_tags": tags,
                "logger.mlflow_log_artifacts": False,
            }
        )
    return o


def _parse_value(raw: str) -> Any:
    """``extra_overrides`` values: JSON when they parse (numbers, true, null, lists), else text."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def override_lines(overrides: dict[str, Any]) -> list[str]:
    """``key=value`` lines, values in JSON (strings quoted, ``null``, ``true``)."""
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def apply_overrides(root: Any, overrides: dict[str, Any]) -> None:
    """Set each dotted key on a dataclass tree; every segment must name a dataclass field.

    Unknown keys are collected and raised together (ValueError), before anything is set:
    a plain ``setattr`` would silently add an attribute Bridge never reads."""
    from dataclasses import fields, is_dataclass

    unknown: list[str] = []
    targets: list[tuple[Any, str, Any]] = []
    for key, value in overrides.items():
        node, parts = root, key.split(".")
        for i, part in enumerate(parts):
            names = {f.name for f in fields(node)} if is_dataclass(node) else set()
            if part not in names:
                where = ".".join(parts[:i]) or "the config"
                unknown.append(f"{key}: {type(node).__name__} at {where} has no field {part!r}")
                break
            if i == len(parts) - 1:
                targets.append((node, part, value))
            else:
                node = getattr(node, part)
    if unknown:
        raise ValueError("unknown Megatron-Bridge config keys:\n  " + "\n  ".join(unknown))
    for node, name, value in targets:
        setattr(node, name, value)


def megatron_problems(cfg: PipelineConfig, *, world_size: int | None = None) -> list[str]:
    """What stops this config from running as a Megatron-Bridge job (empty when it can).

    ``world_size`` defaults to the train job's ``nodes × nproc_per_node`` (or GPUs per node)."""
    p: list[str] = []
    s = cfg.executor.slurm
    if world_size is None:
        world_size = s.nodes * (s.nproc_per_node or s.gpus_per_node)
    if not cfg.model.path:
        p.append("model.path must name the HF Qwen3-VL checkpoint dir (Bridge loads base weights)")
    if not cfg.processor.path:
        p.append("processor.path must name the model's HF processor dir (not the tiny one)")
    if cfg.train.micro_batch_size != 1:
        p.append("train.micro_batch_size must be 1 (one pack per micro-batch)")
    if cfg.packing.enabled and cfg.packing.algorithm.value != "ffd":
        p.append("packing.algorithm must be ffd: Bridge's encoder selects first-fit decreasing")
    ep = cfg.megatron.expert_parallel
    if ep > 1 and not cfg.model.moe:
        p.append(f"megatron.expert_parallel {ep} needs model.moe: true (a dense model has none)")
    model_parallel = cfg.packing.tensor_parallel * cfg.packing.context_parallel
    if world_size < 1 or world_size % model_parallel:
        p.append(
            f"{world_size} GPUs do not split into TP {cfg.packing.tensor_parallel} × CP "
            f"{cfg.packing.context_parallel} groups"
        )
    else:
        dp = world_size // model_parallel
        if cfg.train.global_batch_size % dp:
            p.append(
                f"train.global_batch_size {cfg.train.global_batch_size} is not a multiple of "
                f"the data-parallel size {dp}"
            )
    if cfg.model.moe and world_size % ep:  # expert TP 1, PP 1: EP groups tile the world
        p.append(f"megatron.expert_parallel {ep} does not divide the {world_size} GPUs")
    try:
        lora_target_modules(cfg)
    except ConfigError as exc:
        p += exc.problems
    return p
