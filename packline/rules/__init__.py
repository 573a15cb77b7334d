"""Every rule packline checks a run against, in one place, as one :class:`~schemas.rules.Rule`
type gathered in :class:`~schemas.rules.RuleBook` s:

- the config's own: each section's types and ranges (``schemas/config.py``) and the rules
  across sections — packing, Megatron-Bridge's packing guardrails on packline's settings,
  what a config may not hold (shell syntax, data where a run replaces its outputs) — and the
  SLURM rules (``schemas/rules.py``). They live on the bottom floor because
  ``load_config`` refuses their errors before anything imports torch;
- the Megatron rules on the overrides Bridge will really get (:mod:`packline.rules.megatron`);
- the data against the config (:mod:`packline.rules.data`: connect's tables);
- the model against the data (:mod:`packline.rules.model`: processor, model config, LoRA).

:func:`collect` runs them all, in that order; validate writes and prints what it returns,
and ``packline run --executor slurm`` refuses the errors of the SLURM and Megatron books
before it submits.
"""

from __future__ import annotations

from packline.megatron.overrides import bridge_alignment
from packline.rules.data import DATA_RULES
from packline.rules.inputs import Inputs, Upstream, load_inputs
from packline.rules.megatron import megatron_findings
from packline.rules.model import MODEL_RULES
from schemas.config import PipelineConfig, section_findings
from schemas.rules import CONFIG_RULES, SLURM_RULES, Check, Finding


def collect(cfg: PipelineConfig, upstream: Upstream) -> tuple[list[Finding], list[Check], Inputs]:
    """Every rule, in order: config sections, guardrails, SLURM, Megatron, data, model;
    what broke, each rule's status, and the inputs the data and model rules read from
    ``upstream`` (with the figures they computed in ``facts``)."""
    megatron_found, megatron_ran, run = megatron_findings(cfg)
    inputs = load_inputs(cfg, upstream, bridge_alignment(run) if run is not None else None)
    findings: list[Finding] = []
    checks: list[Check] = []
    for found, ran in (
        section_findings(cfg),
        CONFIG_RULES.run(cfg),
        SLURM_RULES.run(cfg),
        (megatron_found, megatron_ran),
        DATA_RULES.run(inputs),
        MODEL_RULES.run(inputs),
    ):
        findings += found
        checks += ran
    return findings, checks, inputs


def findings_table(findings: list[Finding], num_rules: int):
    """The readable summary: one row per error and warning."""
    from rich.markup import escape
    from rich.table import Table

    errors = sum(f.severity == "error" for f in findings)
    table = Table(
        title=f"validate: {errors} error(s), {len(findings) - errors} warning(s) "
        f"from {num_rules} rules",
        title_justify="left",
        show_lines=True,
    )
    for col in ("", "setting", "rule", "problem", "fix"):
        table.add_column(col, overflow="fold")
    for f in sorted(findings, key=lambda f: f.severity != "error"):
        level = "[red]error[/]" if f.severity == "error" else "[yellow]warning[/]"
        table.add_row(level, *(escape(t) for t in (f.setting, f.requires, f.message, f.fix)))
    return table
