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
- MoE (``model.moe``): EP from ``train.parallel.expert_parallel``, expert TP 1, no MTP, the
  ``alltoall`` dispatcher, EP communication overlap and delayed wgrad off; EP > 1 packs
  fixed-width rows (``dataset.pad_to_max_length``); sequence parallelism on with TP > 1, as
  Bridge's MoE provider turns it on anyway.
- evaluation every ``train.eval_every`` steps (else once, at the end), none with
  ``train.eval: false`` (``validation.eval_iters=0``: Bridge builds no validation dataset).
- schedule: AdamW (``train.adam_beta1``, ``adam_beta2``) with ``train.weight_decay`` in the
  optimizer *and* the scheduler's ``start_weight_decay``/``end_weight_decay`` (the scheduler
  writes every param group's decay each step from those: the recipes' 0.033 would otherwise
  decay the adapters).
- LoRA, checkpoints (resume from ``<work>/train/megatron/checkpoints``), and Bridge's own MLflow
  logger pointed at packline's store and experiment.

``megatron.extra_overrides`` are applied last, so they win. The Megatron rules
(:mod:`packline.rules.megatron`, run by the validate stage, by ``packline run --executor
slurm`` and by the in-container entry) therefore read the overrides Bridge will really get
(:class:`BridgeRun`): every extra key must name a field of Bridge's config (the table in
:mod:`packline.megatron.fields`, generated from the pinned release's source) and keep Bridge's
guardrails.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

from packline.catalog import dataset_dir, lengths_path, processor_dir, stage_dir
from packline.energon.files import BRIDGE_METADATASET
from packline.qwen.processor import image_geometry
from packline.tracking import experiment_name, tracking_uri
from schemas.choices import ATTENTION_PROJECTIONS, EXPERT_PARAMETERS, MLP_PROJECTIONS, Packer
from schemas.config import PipelineConfig
from schemas.errors import UserError

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
assert set(LORA_TARGETS) == {*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, *EXPERT_PARAMETERS}

#: The concrete Bridge classes behind the ConfigContainer's union-typed sections for the runs
#: packline builds (the other sections have one declared type on ConfigContainer).
DATASET_CLASS = "megatron.bridge.data.builders.energon.EnergonDatasetConfig"
#: packline's dataset for Bridge (``packing.packer: packline``), a ``DatasetProvider``; its
#: fields are in the field table beside Bridge's (generated from its source).
PACKLINE_DATASET_CLASS = "packline.megatron.dataset.PacklineEnergonDataset"
TASK_ENCODER_CLASS = "megatron.bridge.data.builders.energon.QwenVLEnergonTaskEncoderConfig"
LORA_CLASS = "megatron.bridge.peft.lora.LoRA"
DENSE_MODEL_CLASS = "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLModelProvider"
MOE_MODEL_CLASS = "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLMoEModelProvider"
RECIPE_MODULE = "megatron.bridge.recipes.qwen_vl"


def packs_with_packline(cfg: PipelineConfig) -> bool:
    """Bridge's dataset is packline's (``packing.packer: packline``, packing on)."""
    return cfg.packing.enabled and cfg.packing.packer is Packer.packline


def section_classes(cfg: PipelineConfig) -> dict[str, str]:
    """Dotted prefix → qualified class name of the concrete config object there."""
    return {
        "model": MOE_MODEL_CLASS if cfg.model.moe else DENSE_MODEL_CLASS,
        "dataset": PACKLINE_DATASET_CLASS if packs_with_packline(cfg) else DATASET_CLASS,
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
    (order kept, duplicates dropped). Raises UserError naming every unmappable target."""
    problems = lora_target_problems(cfg)
    if problems:
        raise UserError(problems)
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
    return str(stage_dir(cfg, "train") / "megatron" / "checkpoints")


def bridge_overrides(
    cfg: PipelineConfig, *, mlflow_tags: dict[str, str] | None = None
) -> dict[str, Any]:
    """Every ConfigContainer field packline sets, as ``{"dotted.key": value}`` in apply order:
    packline's own, then ``megatron.extra_overrides`` (which win).

    ``mlflow_tags`` are added to packline's own tags on Bridge's MLflow run (the train stage
    passes the run it nests under). Raises UserError for LoRA targets with no Megatron name."""
    o = _packline_overrides(cfg, lora_target_modules(cfg), mlflow_tags)
    o.update(extra_overrides(cfg))
    return o


#: Bridge's task-encoder field for the frames it keeps of each video (the first ones).
MAX_NUM_FRAMES = "dataset.task_encoder.max_num_frames"


def max_num_frames(cfg: PipelineConfig) -> int:
    """The ``max_num_frames`` Bridge's encoder gets: ``prepare.max_frames_per_video``, which
    no pre-sampled video exceeds, unless ``megatron.extra_overrides`` replaces it (then
    connect measures the videos cut to it, and validate warns with the count)."""
    return int(extra_overrides(cfg).get(MAX_NUM_FRAMES, cfg.prepare.max_frames_per_video))


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
    ep = t.parallel.expert_parallel
    o: dict[str, Any] = {
        # data: the prepared Energon dataset and the processor connect measured lengths with
        "dataset.path": str(dataset_dir(cfg) / BRIDGE_METADATASET),
        "dataset.seq_length": p.seq_length,
        "dataset.num_workers": t.num_workers,
        # the training stream's shape, as the local loader reads it
        "dataset.shuffle_buffer_size": t.shuffle_buffer_size,
        "dataset.max_samples_per_sequence": t.max_samples_per_sequence,
        "dataset.packing_buffer_size": p.packing_buffer_size if p.enabled else None,
        "dataset.pad_to_max_length": p.pad_to_max_length or ep > 1,
        "dataset.task_encoder.hf_processor_path": str(processor_dir(cfg)),
        "dataset.task_encoder.max_num_images": m.max_num_images,
        "dataset.task_encoder.max_visual_tokens": m.max_visual_tokens,
        # every video's pre-sampled frames (prepare rejects a video of more than
        # prepare.max_frames_per_video): Bridge's default, 60, would keep only the first 60
        MAX_NUM_FRAMES: cfg.prepare.max_frames_per_video,
        # the visual geometry connect measured with (Bridge's defaults — min 200,704 and max
        # 1,003,520 pixels, patch 14 — would change every image's token count)
        **_geometry_overrides(cfg),
        "model.seq_length": p.seq_length,
        **(_packline_packing(cfg) if packs_with_packline(cfg) else {}),
        # packing requirements: one pack per micro-batch, loss normalized over tokens
        "dataset.micro_batch_size": 1,
        "train.micro_batch_size": 1,
        # the settings validate checks (megatron.*): what packing needs, or it stops there
        "model.calculate_per_token_loss": m.calculate_per_token_loss,
        "ddp.average_in_collective": m.average_in_collective,
        "model.pipeline_model_parallel_size": t.parallel.pipeline_parallel,
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
            "optimizer.adam_beta1": t.adam_beta1,
            "optimizer.adam_beta2": t.adam_beta2,
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
    if not t.eval:  # no validation dataset is built, none is read (a set without val rows)
        o["validation.eval_iters"] = 0
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


def _packline_packing(cfg: PipelineConfig) -> dict[str, Any]:
    """packline's packer in Bridge (:class:`~packline.megatron.dataset.PacklineEnergonDataset`):
    connect's exact lengths, the selection, carry-over, and the CP/SP alignment (Bridge computes
    it only for its own ``EnergonDatasetConfig``)."""
    p = cfg.packing
    return {
        "dataset.lengths_path": str(lengths_path(cfg)),
        "dataset.algorithm": p.algorithm.value,
        "dataset.max_carry_rounds": p.max_carry_rounds,
        "dataset.balance": p.balance.value,
        "dataset.seed": cfg.train.seed,
        "dataset.in_batch_packing_pad_to_multiple_of": p.alignment,
    }


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


# --- Bridge's config fields (the table generated from the pinned release) -------------------


def _class_fields(qualified: str) -> dict[str, str]:
    """Every field of a Bridge config class (inherited ones too) → its nested config class."""
    from packline.megatron.fields import CLASSES

    bases, plain, nested = CLASSES[qualified]
    out: dict[str, str] = {}
    for base in bases:
        out.update(_class_fields(base))
    out.update(dict.fromkeys(plain.split(), ""))
    out.update(nested)
    return out


def unknown_field(key: str, classes: dict[str, str]) -> str | None:
    """Why ``key`` names no field of Bridge's ConfigContainer (None when it does). ``classes``
    are the concrete classes of the union-typed sections (:func:`section_classes`)."""
    from packline.megatron.fields import CLASSES, CONTAINER

    qualified, parts = CONTAINER, key.split(".")
    for i, part in enumerate(parts):
        known = _class_fields(qualified)
        if part not in known:
            where = ".".join(parts[:i]) or "the top level"
            close = difflib.get_close_matches(part, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{qualified.rsplit('.', 1)[-1]} at {where} has no field {part!r}{hint}"
        if i == len(parts) - 1:
            return None
        prefix = ".".join(parts[: i + 1])
        qualified = classes.get(prefix) or known[part]
        if qualified not in CLASSES:
            return f"{prefix} holds no config dataclass, so nothing inside it can be set"
    return None


# --- the Megatron rules: what the Bridge run must keep --------------------------------------


@dataclass(frozen=True)
class BridgeRun:
    """The Bridge run a config makes, as the Megatron rules read it: packline's overrides and
    the extra ones, which are applied last and so are what Bridge really gets."""

    cfg: PipelineConfig
    base: dict[str, Any]
    """What packline's own settings send (``bridge_overrides`` without the extra ones)."""
    extra: dict[str, Any]
    """What ``megatron.extra_overrides`` set."""
    world_size: int
    """GPUs of the train job."""

    def get(self, key: str, default: Any = None) -> Any:
        """The value Bridge gets for ``key`` (``default``: the recipe's, which packline cannot
        read off the cluster)."""
        if key in self.extra:
            return self.extra[key]
        return self.base.get(key, default)

    def setting(self, key: str, own: str) -> str:
        """The setting to change for ``key``: the extra override when one sets it, else
        packline's own setting ``own``."""
        return "megatron.extra_overrides" if key in self.extra else own

    def removal(self, *keys: str) -> str:
        """The fix for ``keys`` that packline's own overrides always send right (only an extra
        override can break them): remove those the extra overrides set."""
        named = [k for k in keys if k in self.extra] or list(keys[:1])
        return f"remove {' and '.join(named)} from megatron.extra_overrides"

    def shown(self, key: str) -> str:
        """``key=value`` as Bridge gets it, saying when an extra override set it."""
        where = " (from megatron.extra_overrides)" if key in self.extra else ""
        return f"{key}={json.dumps(self.get(key))}{where}"

    @property
    def packing(self) -> bool:
        """Energon native packing is on (Bridge: ``dataset.packing_buffer_size`` is set)."""
        return self.get("dataset.packing_buffer_size") is not None


def default_world_size(cfg: PipelineConfig) -> int:
    """GPUs of the SLURM train job: ``nodes × nproc_per_node`` (or GPUs per node)."""
    s = cfg.executor.slurm
    return s.nodes * (s.nproc_per_node or s.gpus_per_node)


def bridge_run(cfg: PipelineConfig, *, world_size: int | None = None) -> BridgeRun:
    """The run to check; LoRA targets with no Megatron name are left out of it (the rule
    ``megatron.lora_targets`` reports them), so that every other rule still runs."""
    return BridgeRun(
        cfg=cfg,
        base=_packline_overrides(cfg, _mapped_targets(cfg), None),
        extra=extra_overrides(cfg),
        world_size=default_world_size(cfg) if world_size is None else world_size,
    )


def bridge_alignment(run: BridgeRun) -> int:
    """The multiple every conversation of a packed row is padded to, as the run has it:
    ``lcm(2·CP if CP > 1, CP·TP if SP and TP > 1)`` over the train and eval CP sizes
    (``ConfigContainer.validate``), with sequence parallelism on for an MoE model with
    TP > 1 (its provider turns it on after that check)."""
    cp = int(run.get("model.context_parallel_size") or 1)
    eval_cp = run.get("dist.eval_context_parallel_size")
    tp = int(run.get("model.tensor_model_parallel_size") or 1)
    sp = bool(run.get("model.sequence_parallel")) or (run.cfg.model.moe and tp > 1)
    sizes = {cp} if eval_cp is None else {cp, int(eval_cp)}
    terms = [2 * c if c > 1 else 1 for c in sizes] + [c * tp if sp and tp > 1 else 1 for c in sizes]
    return math.lcm(*terms)
