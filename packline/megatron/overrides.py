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
- schedule: AdamW with ``train.weight_decay`` in the optimizer *and* the scheduler's
  ``start_weight_decay``/``end_weight_decay`` (the scheduler writes every param group's decay
  each step from those: the recipes' 0.033 would otherwise decay the adapters).
- LoRA, checkpoints (resume from ``<work>/train/megatron/checkpoints``), and Bridge's own MLflow
  logger pointed at packline's store and experiment.

``megatron.extra_overrides`` are applied last, so they win. The Megatron rules
(:data:`MEGATRON_RULES`, run by the validate stage, by ``packline run --executor slurm`` and by
the in-container entry) therefore read the overrides Bridge will really get: every extra key
must name a field of Bridge's config (the table in :mod:`packline.megatron.fields`, generated from
the pinned release's source) and keep Bridge's guardrails.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from packline.energon.files import BRIDGE_METADATASET
from packline.qwen.processor import image_geometry
from packline.tracking import experiment_name, tracking_uri
from packline.workdir import dataset_dir, processor_dir, stage_dir
from schemas.config import ExecutorKind, PipelineConfig, TrainBackend
from schemas.errors import UserError
from schemas.guardrails import Check, Finding, Issue, RuleBook, Severity, error, warning

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


MEGATRON_RULES = RuleBook()


def _megatron(run: BridgeRun) -> bool:
    return run.cfg.train.backend is TrainBackend.megatron


@MEGATRON_RULES.rule(
    "megatron.executor", "megatron", "train.backend megatron runs as a SLURM job (its container)"
)
def _executor(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    if run.cfg.executor.kind is ExecutorKind.slurm:
        return []
    return [
        error(
            "executor.kind",
            f"executor.kind is '{run.cfg.executor.kind.value}': train.backend megatron runs "
            "only inside the cluster's NeMo container, as a SLURM job",
            "run with --executor slurm (executor.kind=slurm)",
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.paths",
    "megatron",
    "model.path and processor.path name the model's HF checkpoint and processor dirs",
)
def _paths(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    cfg, out = run.cfg, []
    if not cfg.model.path:
        out.append(
            error(
                "model.path",
                "model.path is not set: Megatron-Bridge loads the base weights from the HF "
                "Qwen3-VL checkpoint dir",
                "set model.path to the checkpoint dir, as the cluster's jobs see it",
            )
        )
    if not cfg.processor.path:
        out.append(
            error(
                "processor.path",
                "processor.path is not set: Megatron-Bridge needs the model's HF processor, "
                "not packline's built-in tiny one",
                "set processor.path to the model's processor dir (usually model.path)",
            )
        )
    return out


@MEGATRON_RULES.rule(
    "megatron.micro_batch_setting",
    "megatron",
    "train.micro_batch_size is 1: packline sends Megatron-Bridge one row per micro-batch",
)
def _micro_batch_setting(run: BridgeRun) -> list[Issue] | None:
    cfg = run.cfg
    if not _megatron(run) or cfg.trains_packed:
        return None  # packed: the guardrail packing.micro_batch checks it
    mbs = cfg.train.micro_batch_size
    if mbs == 1:
        return []
    return [
        error(
            "train.micro_batch_size",
            f"train.micro_batch_size is {mbs}, but with train.backend megatron packline sends "
            "train.micro_batch_size=1 to Megatron-Bridge",
            "set train.micro_batch_size=1",
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.algorithm",
    "megatron",
    "packing.algorithm is ffd: Megatron-Bridge's encoder selects first-fit decreasing",
)
def _algorithm(run: BridgeRun) -> list[Issue] | None:
    cfg = run.cfg
    if not _megatron(run) or not cfg.packing.enabled:
        return None
    algorithm = cfg.packing.algorithm.value
    if algorithm == "ffd":
        return []
    return [
        error(
            "packing.algorithm",
            f"packing.algorithm is '{algorithm}', but Megatron-Bridge's encoder selects packs "
            "by plain first-fit decreasing: connect's forecast would describe other packs",
            "set packing.algorithm=ffd",
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.dense_experts", "megatron", "train.parallel.expert_parallel > 1 only on an MoE model"
)
def _dense_experts(run: BridgeRun) -> list[Issue] | None:
    cfg = run.cfg
    if not _megatron(run):
        return None
    ep = cfg.train.parallel.expert_parallel
    if ep == 1 or cfg.model.moe:
        return []
    return [
        error(
            "train.parallel.expert_parallel",
            f"train.parallel.expert_parallel is {ep}, but model.moe is false: a dense model has no "
            "experts to split",
            "set train.parallel.expert_parallel=1 (or model.moe=true for an MoE model)",
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.world",
    "megatron",
    "the train job's GPUs split into TP × CP groups and EP groups, and the data-parallel "
    "size divides the global batch",
)
def _world(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    world = run.world_size
    tp = int(run.get("model.tensor_model_parallel_size") or 1)
    cp = int(run.get("model.context_parallel_size") or 1)
    gbs = int(run.get("train.global_batch_size"))
    gpus = "executor.slurm.gpus_per_node"
    out = []
    if world < 1 or world % (tp * cp):
        out.append(
            error(
                gpus,
                f"the train job's {world} GPUs do not split into TP {tp} × CP {cp} groups",
                f"use a multiple of {tp * cp} GPUs (executor.slurm.nodes × gpus_per_node)",
            )
        )
    elif gbs % (world // (tp * cp)):
        dp = world // (tp * cp)
        out.append(
            error(
                run.setting("train.global_batch_size", "train.global_batch_size"),
                f"train.global_batch_size {gbs} is not a multiple of the data-parallel size "
                f"{dp} ({world} GPUs / (TP {tp} × CP {cp}))",
                f"set train.global_batch_size={max(dp, gbs // dp * dp)}",
            )
        )
    ep = int(run.get("model.expert_model_parallel_size") or 1)
    if run.cfg.model.moe and world >= 1 and world % ep:  # expert TP 1, PP 1: EP tiles the world
        out.append(
            error(
                run.setting("model.expert_model_parallel_size", "train.parallel.expert_parallel"),
                f"train.parallel.expert_parallel {ep} does not divide the train job's {world} GPUs",
                f"use a multiple of {ep} GPUs, or an expert_parallel that divides {world}",
            )
        )
    return out


@MEGATRON_RULES.rule(
    "megatron.lora_targets",
    "megatron",
    "every LoRA target has a Megatron module name (lora.target_modules, target_parameters)",
)
def _lora_targets(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    return [
        error(
            "lora.target_modules",
            problem,
            "name only those targets (packline maps them to Megatron's fused linears)",
        )
        for problem in lora_target_problems(run.cfg)
    ]


@MEGATRON_RULES.rule(
    "megatron.extra_override_fields",
    "megatron",
    "every megatron.extra_overrides key names a field of Megatron-Bridge's config "
    "(packline/megatron/fields.py, from the pinned release)",
)
def _extra_override_fields(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    classes = section_classes(run.cfg)
    out = []
    for key in run.extra:
        why = unknown_field(key, classes)
        if why is not None:
            out.append(
                error(
                    "megatron.extra_overrides",
                    f"megatron.extra_overrides key {key!r} is not a Megatron-Bridge config "
                    f"field: {why}",
                    f"correct or remove {key!r} in megatron.extra_overrides",
                )
            )
    return out


class _Guard(NamedTuple):
    """A guardrail on one key: what Bridge's native packing requires of its value, and the
    packline setting (checked by a config rule) that sends it."""

    key: str
    requires: str
    holds: Callable[[Any], bool]
    own: str
    severity: Severity = "error"


#: Bridge's native-packing guardrails on keys packline sends from a ``megatron.*`` setting.
#: packline's own values are checked by the config rules (schemas/guardrails.py); an extra
#: override replaces them, so it is checked here, as the value Bridge gets.
PACKING_GUARDS = (
    _Guard(
        "model.calculate_per_token_loss",
        "true (a per-token loss)",
        lambda v: v is True,
        "megatron.calculate_per_token_loss",
    ),
    _Guard(
        "ddp.average_in_collective",
        "false (gradients summed)",
        lambda v: v is False,
        "megatron.average_in_collective",
    ),
    _Guard("model.mtp_num_layers", "0 (no MTP)", lambda v: not v, "megatron.mtp_num_layers"),
    _Guard(
        "model.cuda_graph_impl",
        '"none" (no CUDA graphs)',
        lambda v: v in (None, "none"),
        "megatron.cuda_graph_impl",
    ),
    _Guard(
        "model.vision_cuda_graph_impl",
        '"none" (no CUDA graphs)',
        lambda v: v in (None, "none"),
        "megatron.vision_cuda_graph_impl",
    ),
    _Guard(
        "model.pipeline_model_parallel_size",
        "1 (no pipeline parallelism)",
        lambda v: (v or 1) == 1,
        "train.parallel.pipeline_parallel",
    ),
    _Guard(
        "model.overlap_moe_expert_parallel_comm",
        "false (Bridge turns it off)",
        lambda v: not v,
        "megatron.overlap_moe_expert_parallel_comm",
        "warning",
    ),
    _Guard(
        "model.delay_wgrad_compute",
        "false (Bridge turns it off)",
        lambda v: not v,
        "megatron.delay_wgrad_compute",
        "warning",
    ),
)


@MEGATRON_RULES.rule(
    "megatron.extra_override_guardrails",
    "megatron",
    "megatron.extra_overrides keep Megatron-Bridge's native-packing guardrails (they are "
    "applied last: checked as the values Bridge gets)",
)
def _extra_override_guardrails(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run) or not run.packing:
        return None
    out = []
    for g in PACKING_GUARDS:
        if g.key in run.extra and not g.holds(run.extra[g.key]):
            out.append(
                Issue(
                    g.severity,
                    "megatron.extra_overrides",
                    f"{run.shown(g.key)}: Energon native packing in Megatron-Bridge needs "
                    f"{g.key} {g.requires}",
                    f"remove {g.key} from megatron.extra_overrides (packline sends it from "
                    f"{g.own})",
                )
            )
    return out


#: Keys whose values connect measured or validate's data rules read, → packline's setting.
MEASURED = {
    "dataset.path": "prepare's output (work_dir)",
    "dataset.seq_length": "packing.seq_length",
    "model.seq_length": "packing.seq_length",
    "dataset.packing_buffer_size": "packing.packing_buffer_size",
    "dataset.pad_to_max_length": "packing.pad_to_max_length",
    "dataset.task_encoder.hf_processor_path": "connect's processor (processor.path)",
    "dataset.task_encoder.max_num_images": "megatron.max_num_images",
    "dataset.task_encoder.max_visual_tokens": "megatron.max_visual_tokens",
    "dataset.task_encoder.min_pixels": "processor.min_pixels",
    "dataset.task_encoder.max_pixels": "processor.max_pixels",
    "dataset.task_encoder.patch_size": "processor.patch_size",
    "dataset.task_encoder.temporal_patch_size": "processor.temporal_patch_size",
    "dataset.task_encoder.spatial_merge_size": "processor.merge_size",
    "model.tensor_model_parallel_size": "packing.tensor_parallel",
    "model.context_parallel_size": "packing.context_parallel",
    "model.sequence_parallel": "packing.sequence_parallel",
    "model.expert_model_parallel_size": "train.parallel.expert_parallel",
}


@MEGATRON_RULES.rule(
    "megatron.extra_override_measured",
    "megatron",
    "megatron.extra_overrides do not change what connect measured and validate checked "
    "(sequence length, buffer, parallelism, dataset, processor and its visual geometry)",
)
def _extra_override_measured(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    return [
        error(
            "megatron.extra_overrides",
            f"{run.shown(key)} replaces packline's {json.dumps(run.base.get(key))} from "
            f"{own}: connect measured, and validate checked, the data with packline's value",
            f"remove {key} from megatron.extra_overrides and change {own} instead",
        )
        for key, own in MEASURED.items()
        if key in run.extra and run.extra[key] != run.base.get(key)
    ]


@MEGATRON_RULES.rule(
    "megatron.micro_batch",
    "megatron",
    "Megatron-Bridge's train and dataset micro-batches are equal, and 1 with native packing",
)
def _micro_batch(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    keys = ("train.micro_batch_size", "dataset.micro_batch_size")
    train, dataset = (run.get(k) for k in keys)
    if run.packing:
        return [
            error(
                "megatron.extra_overrides",
                f"{run.shown(k)}: Energon native packing in Megatron-Bridge needs one packed "
                "row per micro-batch",
                run.removal(k),
            )
            for k in keys
            if run.get(k) != 1
        ]
    if train == dataset:
        return []
    return [
        error(
            "megatron.extra_overrides",
            f"{run.shown(keys[0])} and {run.shown(keys[1])}: Megatron-Bridge requires the "
            "Energon dataset's micro-batch to equal the training micro-batch",
            run.removal(*keys),
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.eval_micro_batch",
    "megatron",
    "validation.eval_micro_batch_size equals the Energon dataset's micro-batch",
)
def _eval_micro_batch(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run) or run.get("dataset.do_validation", True) is False:
        return None
    key = "validation.eval_micro_batch_size"
    evaluated = run.get(key)
    if evaluated is None:  # Bridge resolves it to the training micro-batch
        evaluated = run.get("train.micro_batch_size")
    dataset = run.get("dataset.micro_batch_size")
    if evaluated == dataset:
        return []
    fix = run.removal(key, "dataset.micro_batch_size", "train.micro_batch_size")
    return [
        error(
            "megatron.extra_overrides",
            f"{run.shown(key)}, but the Energon dataset's micro-batch is {dataset}: "
            "Megatron-Bridge requires them equal (the eval loader batches as the dataset does)",
            fix,
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.dist_train",
    "megatron",
    "Energon native packing in Megatron-Bridge needs Qwen3-VL DistTrain off",
)
def _dist_train(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run) or not run.packing:
        return None
    key = "model.dist_train.use_dist_train"
    if not run.get(key):
        return []
    return [
        error(
            "megatron.extra_overrides",
            f"{run.shown(key)}: Megatron-Bridge's native packing does not support Qwen3-VL "
            "DistTrain (separate vision and language ranks)",
            run.removal(key),
        )
    ]


@MEGATRON_RULES.rule(
    "megatron.in_batch_packing",
    "megatron",
    "Energon native packing excludes the legacy in-batch packing flags",
)
def _in_batch_packing(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run) or not run.packing:
        return None
    return [
        error(
            "megatron.extra_overrides",
            f"{run.shown(key)}: Megatron-Bridge's native packing (dataset.packing_buffer_size, "
            "from packing.enabled) and its legacy in-batch packing exclude each other",
            run.removal(key),
        )
        for key in ("dataset.enable_in_batch_packing", "dataset.defer_in_batch_packing_to_step")
        if run.get(key)
    ]


@MEGATRON_RULES.rule(
    "megatron.alignment",
    "megatron",
    "packing.seq_length is a multiple of the alignment the run pads to: lcm(2·CP, CP·TP) over "
    "the train and eval CP sizes, with SP as the run has it (on for MoE with TP > 1)",
)
def _alignment(run: BridgeRun) -> list[Issue] | None:
    if not _megatron(run):
        return None
    p = run.cfg.packing
    m, seq = bridge_alignment(run), int(run.get("dataset.seq_length"))
    if m == p.alignment and seq == p.seq_length:
        return []  # packing's own rule (schemas/config.py) checks this multiple
    cp = int(run.get("model.context_parallel_size") or 1)
    tp = int(run.get("model.tensor_model_parallel_size") or 1)
    eval_cp = run.get("dist.eval_context_parallel_size")
    moe_sp = run.cfg.model.moe and tp > 1 and not run.get("model.sequence_parallel")
    parts = [f"CP {cp}"]
    if eval_cp is not None:
        parts.append(f"eval CP {eval_cp} (dist.eval_context_parallel_size)")
    sp = bool(run.get("model.sequence_parallel")) or moe_sp
    parts.append(f"TP {tp}, SP {'on' if sp else 'off'}")
    why = ", ".join(parts)
    if run.cfg.model.moe and tp > 1 and not p.sequence_parallel:
        why += ": Megatron-Bridge's MoE provider turns sequence parallelism on when TP > 1"
    if seq % m:
        return [
            error(
                "packing.seq_length",
                f"packing.seq_length {seq} is not a multiple of the alignment the run pads "
                f"each conversation to, m = {m} ({why})",
                f"set packing.seq_length={(seq // m + 1) * m} or {max(m, seq // m * m)}",
            )
        ]
    if m == p.alignment:
        return []
    moe_sp_only = run.cfg.model.moe and tp > 1 and not p.sequence_parallel and eval_cp is None
    return [
        warning(
            "packing.sequence_parallel" if moe_sp_only else "megatron.extra_overrides",
            f"the run pads each conversation to m = {m} ({why}), but packing's alignment is "
            f"{p.alignment}: validate's data checks use {m}, connect's forecast used "
            f"{p.alignment}",
            "set packing.sequence_parallel=true and rerun connect"
            if moe_sp_only
            else f"drop the extra override that changes it, or accept that connect's forecast "
            f"assumed m = {p.alignment}",
        )
    ]


def megatron_findings(
    cfg: PipelineConfig, *, world_size: int | None = None
) -> tuple[list[Finding], list[Check], BridgeRun | None]:
    """Every Megatron rule on the run ``cfg`` makes: what broke, each rule's status, and the
    run (None when ``train.backend`` is not megatron, or its overrides cannot be built)."""
    if cfg.train.backend is not TrainBackend.megatron:
        return (
            [],
            [Check(r.id, r.group, r.requires, "not applicable") for r in MEGATRON_RULES.rules],
            None,
        )
    try:
        run = bridge_run(cfg, world_size=world_size)
    except (ValueError, OSError) as exc:  # e.g. a processor dir without its geometry
        requires = "packline's Megatron-Bridge overrides can be built from the config"
        problem = str(exc).strip().splitlines()[0]
        found = Finding(
            "megatron.overrides",
            requires,
            "error",
            "processor.path",
            f"the Megatron-Bridge overrides cannot be built: {problem}",
            "point processor.path at the model's HF processor dir (the overrides send its "
            "image geometry); the other Megatron rules run once the overrides can be built",
        )
        return [found], [Check(found.rule, "megatron", requires, "error")], None
    findings, checks = MEGATRON_RULES.run(run)
    return findings, checks, run


def megatron_problems(cfg: PipelineConfig, *, world_size: int | None = None) -> list[str]:
    """What stops this config from running as a Megatron-Bridge job (empty when it can): the
    errors of the Megatron rules, which the validate stage lists too.

    ``world_size`` defaults to the train job's ``nodes × nproc_per_node`` (or GPUs per node)."""
    findings, _, _ = megatron_findings(cfg, world_size=world_size)
    return [f.text for f in findings if f.severity == "error"]
