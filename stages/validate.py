"""Stage validate: every rule at once, on the laptop, before any GPU hour is spent.

A packed multimodal fine-tune fails late and expensively when one setting is off, and
Megatron-Bridge rejects such settings one at a time at start-up on the cluster. This stage
checks them all together, in seconds, and explains each: the setting, the rule it breaks,
what is wrong (with the values) and the fix.

Outputs in ``<work>/validate/``::

    report.json     errors and warnings (setting, rule, message, fix), every rule run with
                    its status, and the figures the rules computed
    pipeline.yaml   the resolved config that was validated

Rule groups, in order, all in one pass:

- ``config``: each section's types, ranges and enums (``schemas/config.py``);
- ``packing`` / ``megatron``: the cross-section rules on packline's settings
  (``schemas/rules.py``), which ``load_config`` already enforces, so a config breaking
  one stops before any stage runs;
- ``slurm``: what ``packline run --executor slurm`` refuses (``schemas/rules.py``);
- ``megatron`` (``train.backend: megatron``): the Megatron rules on the overrides Bridge will
  really get, packline's plus ``megatron.extra_overrides`` (applied last), the same rules
  ``run --executor slurm`` refuses (``packline/megatron/overrides.py``): paths, executor, GPUs
  into TP × CP, EP and data-parallel groups, LoRA names, every extra key a field of Bridge's
  config (``packline/megatron/fields.py``), Bridge's packing guardrails on the extra values,
  micro-batches (train, dataset, eval), DistTrain off, no legacy in-batch packing, and the
  alignment with the eval CP size and the SP the MoE provider turns on;
- ``data``: connect's tables against the config — overlength samples (aligned as the run
  pads them) and the overlength policy, images per sample, forecast fill at the configured
  buffer, loader-worker memory of the buffer, and the pandera cross-table checks of manifest
  and lengths; for ``train.backend: megatron``, Bridge's encoder limits (images, and image
  plus video tokens, per sample), the turns it renders media first, and its videos (connect's
  ``bridge_videos.json``: frames cut by ``max_num_frames`` or re-sampled by a processor dir
  that samples, and the timestamps it writes, positions over 24 fps);
- ``model``: the processor against the model config (special-token ids, vocabulary, vision
  geometry, vision → text width) and the LoRA targets against the model's modules and
  parameters. The model is built on the meta device from its config: no weight is read.

The rules live in ``packline/rules/`` (:func:`packline.rules.collect` runs them all). Any
error raises :class:`~schemas.errors.UserError` (exit 2) listing all of them, after the
report is written; warnings never stop the run. The completion record, which the train
stage requires, is written only when there is no error.
"""

from __future__ import annotations

import json
import time

from omegaconf import OmegaConf

import packline
from packline.catalog import (
    VALIDATED_CONFIG,
    bridge_videos_path,
    lengths_path,
    manifest_path,
    processor_dir,
    read_forecast,
    read_record,
)
from packline.fingerprints import stage_fingerprint
from packline.progress import console
from packline.rules import collect, findings_table
from packline.rules.inputs import Upstream
from schemas.config import PipelineConfig
from schemas.errors import UserError
from stages.base import StageResult, building, require_record, stage_dir, stage_result, write_record

STAGE = "validate"


def upstream(cfg: PipelineConfig) -> Upstream:
    """What the rules read of prepare's and connect's outputs, from the catalog."""
    record = read_record(cfg.work_path, "connect") or {}
    return Upstream(
        manifest=manifest_path(cfg),
        lengths=lengths_path(cfg),
        processor_dir=processor_dir(cfg),
        connect_dir=stage_dir(cfg, "connect"),
        bridge_videos=bridge_videos_path(cfg),
        connect_current=record.get("fingerprint") == stage_fingerprint(cfg, "connect"),
    )


def validate(cfg: PipelineConfig, fp: str | None = None) -> StageResult:
    """Check the config, connect's data and the model against each other, all at once."""
    t0 = time.perf_counter()
    fp = fp or stage_fingerprint(cfg, STAGE)
    require_record(cfg.work_path, "connect", by="validate")
    findings, checks, inputs = collect(cfg, upstream(cfg))
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity == "warning"]
    # connect's FLOPs forecast of one epoch, packing on vs off: shown again here, the last
    # look before training, as the `flops/*` metrics connect logged.
    flops = inputs.facts["flops_forecast"] = read_forecast(cfg).get("flops", {})
    report = {
        "ok": not errors,
        "errors": [f.to_dict() for f in errors],
        "warnings": [f.to_dict() for f in warnings],
        "checks": [c.to_dict() for c in checks],
        "facts": inputs.facts,
        "packline_version": packline.__version__,
    }
    with building(cfg.work_path, STAGE) as out:
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / VALIDATED_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    out_dir = stage_dir(cfg, STAGE)
    if findings:
        console.print(findings_table(findings, len(checks)))
    else:
        console.log(f"[green]validate: all {len(checks)} rules hold[/]")
    if "memory" in inputs.facts:  # the train.memory rule's forecast
        console.log(f"memory forecast of a training step: {inputs.facts['memory']['line']}")
    if errors:
        raise UserError(
            [f.text for f in errors],
            f"validate: {len(errors)} error(s) (and {len(warnings)} warning(s)); report: "
            f"{out_dir / 'report.json'}",
        )
    facts = inputs.facts
    metrics: dict[str, float] = {
        "validate/rules": len(checks),
        "validate/errors": 0,
        "validate/warnings": len(warnings),
        "validate/overlength": facts.get("overlength", {}).get("samples", 0),
    }
    if "forecast_fill" in facts:
        metrics["validate/forecast_fill"] = facts["forecast_fill"]["fill"]
    if "worker_memory" in facts:
        wm = facts["worker_memory"]
        metrics["validate/worker_memory_gib"] = wm["per_worker_gib"][wm["mode"]]
    metrics.update({f"flops/{k}": v for k, v in flops.items()})
    result = stage_result(
        cfg.work_path,
        STAGE,
        fp,
        metrics=metrics,
        summary={
            "warnings": [f.text for f in warnings],
            "artifacts": [str(out_dir / "report.json"), str(out_dir / VALIDATED_CONFIG)],
        },
        t0=t0,
    )
    write_record(result)
    return result
