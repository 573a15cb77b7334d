"""The Megatron rules: what a Megatron-Bridge run must keep, read on the overrides Bridge
will really get (packline's own plus ``megatron.extra_overrides``, applied last)
(:class:`packline.megatron.overrides.BridgeRun`). validate lists them; ``packline run
--executor slurm`` refuses their errors before it submits; the train job checks them again
in the container."""

from __future__ import annotations

import json

from packline.backends import backend
from packline.megatron.overrides import (
    BridgeRun,
    bridge_alignment,
    bridge_run,
    lora_target_problems,
    packs_with_packline,
    section_classes,
    unknown_field,
)
from schemas.config import (
    Balance,
    ExecutorKind,
    PipelineConfig,
)
from schemas.rules import (
    BRIDGE_PACKING_GUARDS,
    Check,
    Finding,
    RuleBook,
    error,
    warning,
)

MEGATRON_RULES = RuleBook()


def _megatron(run: BridgeRun) -> bool:
    return backend(run.cfg).renders_for_bridge


@MEGATRON_RULES.rule(
    "megatron.executor", "megatron", "train.backend megatron runs as a SLURM job (its container)"
)
def _executor(run: BridgeRun) -> list[Finding] | None:
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
def _paths(run: BridgeRun) -> list[Finding] | None:
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
def _micro_batch_setting(run: BridgeRun) -> list[Finding] | None:
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
    "packing.packer bridge: packing.algorithm is ffd, packing.max_carry_rounds 0 and "
    "packing.balance none, as Megatron-Bridge's own encoder packs (plain first-fit "
    "decreasing, no carry-over, no FLOPs balance)",
)
def _algorithm(run: BridgeRun) -> list[Finding] | None:
    cfg = run.cfg
    if not _megatron(run) or not cfg.packing.enabled or packs_with_packline(cfg):
        return None
    out = []
    algorithm = cfg.packing.algorithm.value
    if algorithm != "ffd":
        out.append(
            error(
                "packing.algorithm",
                f"packing.algorithm is '{algorithm}', but with packing.packer bridge "
                "Megatron-Bridge's encoder selects packs by plain first-fit decreasing: "
                "connect's forecast would describe other packs",
                "set packing.algorithm=ffd, or packing.packer=packline",
            )
        )
    if cfg.packing.max_carry_rounds:
        out.append(
            error(
                "packing.max_carry_rounds",
                f"packing.max_carry_rounds is {cfg.packing.max_carry_rounds}, but with "
                "packing.packer bridge Energon emits every pack a round selects (no carry-over)",
                "set packing.max_carry_rounds=0, or packing.packer=packline",
            )
        )
    if cfg.packing.balance is not Balance.none:
        out.append(
            error(
                "packing.balance",
                f"packing.balance is '{cfg.packing.balance.value}', but with packing.packer "
                "bridge Megatron-Bridge's encoder selects by length only",
                "set packing.balance=none, or packing.packer=packline",
            )
        )
    return out


@MEGATRON_RULES.rule(
    "megatron.dense_experts", "megatron", "train.parallel.expert_parallel > 1 only on an MoE model"
)
def _dense_experts(run: BridgeRun) -> list[Finding] | None:
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
def _world(run: BridgeRun) -> list[Finding] | None:
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
def _lora_targets(run: BridgeRun) -> list[Finding] | None:
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
def _extra_override_fields(run: BridgeRun) -> list[Finding] | None:
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


@MEGATRON_RULES.rule(
    "megatron.extra_override_guardrails",
    "megatron",
    "megatron.extra_overrides keep Megatron-Bridge's native-packing guardrails (they are "
    "applied last: checked as the values Bridge gets)",
)
def _extra_override_guardrails(run: BridgeRun) -> list[Finding] | None:
    if not _megatron(run) or not run.packing:
        return None
    out = []
    for g in BRIDGE_PACKING_GUARDS:  # the same guardrails the config rules check
        if g.key in run.extra and not g.holds(run.extra[g.key]):
            out.append(
                Finding(
                    g.severity,
                    "megatron.extra_overrides",
                    f"{run.shown(g.key)}: Energon native packing in Megatron-Bridge needs "
                    f"{g.key} {g.key_requires}",
                    f"remove {g.key} from megatron.extra_overrides (packline sends it from "
                    f"{g.setting})",
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
def _extra_override_measured(run: BridgeRun) -> list[Finding] | None:
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
def _micro_batch(run: BridgeRun) -> list[Finding] | None:
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
def _eval_micro_batch(run: BridgeRun) -> list[Finding] | None:
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
def _dist_train(run: BridgeRun) -> list[Finding] | None:
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
    "packing.packer bridge: Energon native packing excludes the legacy in-batch packing flags",
)
def _in_batch_packing(run: BridgeRun) -> list[Finding] | None:
    if not _megatron(run) or not run.packing or packs_with_packline(run.cfg):
        return None  # packline's dataset has no such flags (an extra override is refused)
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
def _alignment(run: BridgeRun) -> list[Finding] | None:
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
    if not backend(cfg).renders_for_bridge:
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
            "error",
            "processor.path",
            f"the Megatron-Bridge overrides cannot be built: {problem}",
            "point processor.path at the model's HF processor dir (the overrides send its "
            "image geometry); the other Megatron rules run once the overrides can be built",
            rule="megatron.overrides",
            requires=requires,
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
