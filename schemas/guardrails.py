"""Cross-section rules of a resolved config: the packing guardrails, and the SLURM rules.

Megatron-Bridge enforces the guardrails at start-up on the cluster, one at a time
(``ConfigContainer.validate()``, ``EnergonDatasetConfig.validate()``). Here each rule is a
small function of the typed config that returns what it finds, so ``load_config`` refuses
every broken one at once (errors only) and the validate stage lists them, warnings too, in
its report. The SLURM rules (:data:`SLURM_RULES`) are what ``packline run --executor slurm``
refuses; validate runs them too. Rules that need more than the config use the same types
(:class:`Finding`, :class:`RuleBook`) and live in ``packline/rules/``: the Megatron rules, on
the overrides Bridge really gets, and the data and model rules (``packline.rules.collect``
runs every book in order).

Every finding names the setting to change, the rule it breaks, what is wrong (with the
values) and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from schemas.choices import STAGES, CudaGraphImpl, ExecutorKind, TrainBackend

if TYPE_CHECKING:  # annotations only: schemas/config.py imports this module to apply the rules
    from schemas.config import PipelineConfig

Severity = Literal["error", "warning"]
Status = Literal["ok", "error", "warning", "not applicable"]


class Issue(NamedTuple):
    """What a rule function returns for one broken rule (the book adds the rule's id)."""

    severity: Severity
    setting: str
    message: str
    fix: str


def error(setting: str, message: str, fix: str) -> Issue:
    return Issue("error", setting, message, fix)


def warning(setting: str, message: str, fix: str) -> Issue:
    return Issue("warning", setting, message, fix)


@dataclass(frozen=True)
class Finding:
    """One broken rule: the setting to change, the rule, what is wrong, and the fix."""

    rule: str
    """Id of the rule, e.g. ``packing.micro_batch``."""
    requires: str
    """What the rule requires, in one line."""
    severity: Severity
    setting: str
    """The dotted config key to change (or the table / file at fault)."""
    message: str
    """What is wrong, with the values found."""
    fix: str
    """What to set or run instead."""

    @property
    def text(self) -> str:
        """The finding as one line of a ``UserError``."""
        return f"{self.message}; fix: {self.fix}"

    def to_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Check:
    """One rule as run: its outcome, for the report (passed rules are listed too)."""

    rule: str
    group: str
    requires: str
    status: Status

    def to_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Rule:
    id: str
    group: str
    requires: str
    fn: Callable[..., list[Issue] | None]
    """Returns the broken rule's issues ([] when it holds), or None when it does not apply."""


@dataclass
class RuleBook:
    """An ordered list of rules of one kind; a rule is a function registered with
    :meth:`rule` that takes the book's arguments."""

    rules: list[Rule] = field(default_factory=list)

    def rule(self, id: str, group: str, requires: str):
        def register(fn: Callable[..., list[Issue] | None]):
            self.rules.append(Rule(id, group, requires, fn))
            return fn

        return register

    def run(self, *args: Any) -> tuple[list[Finding], list[Check]]:
        """Every rule of the book on ``args``: what broke, and each rule's status."""
        findings: list[Finding] = []
        checks: list[Check] = []
        for r in self.rules:
            issues = r.fn(*args)
            found = [Finding(r.id, r.requires, *issue) for issue in issues or []]
            findings += found
            status: Status = "not applicable" if issues is None else "ok"
            if found:
                status = "error" if any(f.severity == "error" for f in found) else "warning"
            checks.append(Check(r.id, r.group, r.requires, status))
        return findings, checks


# --- packing guardrails (any backend that trains packed rows) -------------------------------

CONFIG_RULES = RuleBook()


def _megatron_packed(cfg: PipelineConfig) -> bool:
    return cfg.trains_packed and cfg.train.backend is TrainBackend.megatron


@CONFIG_RULES.rule(
    "packing.micro_batch", "packing", "packing needs a physical micro-batch of one row (MBS 1)"
)
def _micro_batch(cfg: PipelineConfig) -> list[Issue] | None:
    if not cfg.trains_packed:
        return None
    mbs = cfg.train.micro_batch_size
    if mbs == 1:
        return []
    return [
        error(
            "train.micro_batch_size",
            f"train.micro_batch_size is {mbs}, but a packed micro-batch is exactly one row",
            "set train.micro_batch_size=1 (pack more conversations per row instead)",
        )
    ]


@CONFIG_RULES.rule(
    "packing.per_token_loss",
    "packing",
    "packing needs a per-token loss (token losses / loss tokens of the global batch)",
)
def _per_token_loss(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None  # the local backend's loss is per token by construction
    if cfg.megatron.calculate_per_token_loss:
        return []
    return [
        error(
            "megatron.calculate_per_token_loss",
            "megatron.calculate_per_token_loss is false: a per-sequence mean weighs the "
            "conversations of a packed row by how they were packed",
            "set megatron.calculate_per_token_loss=true",
        )
    ]


@CONFIG_RULES.rule(
    "packing.no_collective_average",
    "packing",
    "packing needs gradients summed, not averaged, in the data-parallel all-reduce",
)
def _no_collective_average(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None  # the local backend sums gradients across ranks by construction
    if not cfg.megatron.average_in_collective:
        return []
    return [
        error(
            "megatron.average_in_collective",
            "megatron.average_in_collective is true: averaging in the all-reduce divides "
            "the already globally normalized per-token loss by the DP size again",
            "set megatron.average_in_collective=false",
        )
    ]


@CONFIG_RULES.rule(
    "packing.fixed_width", "packing", "EP > 1 or PP > 1 needs fixed-width packed rows"
)
def _fixed_width(cfg: PipelineConfig) -> list[Issue] | None:
    if not cfg.trains_packed:
        return None
    par = cfg.train.parallel
    if (par.expert_parallel <= 1 and par.pipeline_parallel <= 1) or cfg.packing.pad_to_max_length:
        return []
    return [
        error(
            "packing.pad_to_max_length",
            f"packing.pad_to_max_length is false with train.parallel.expert_parallel "
            f"{par.expert_parallel} and train.parallel.pipeline_parallel "
            f"{par.pipeline_parallel}: EP > 1 or PP > 1 needs every packed row padded to "
            "packing.seq_length",
            "set packing.pad_to_max_length=true",
        )
    ]


# --- Megatron-Bridge with Energon packing (train.backend: megatron) -------------------------


@CONFIG_RULES.rule("megatron.mtp", "megatron", "Energon packing in Megatron-Bridge needs MTP off")
def _mtp(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None
    n = cfg.megatron.mtp_num_layers
    if n == 0:
        return []
    return [
        error(
            "megatron.mtp_num_layers",
            f"megatron.mtp_num_layers is {n}: Megatron-Bridge rejects multi-token "
            "prediction with packed sequences",
            "set megatron.mtp_num_layers=0",
        )
    ]


@CONFIG_RULES.rule(
    "megatron.cuda_graphs", "megatron", "Energon packing in Megatron-Bridge needs CUDA graphs off"
)
def _cuda_graphs(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None
    m = cfg.megatron
    return [
        error(
            f"megatron.{name}",
            f"megatron.{name} is '{value.value}': CUDA graphs replay fixed shapes and "
            "packed rows change shape every step, so Megatron-Bridge rejects them with packing",
            f"set megatron.{name}=none",
        )
        for name, value in (
            ("cuda_graph_impl", m.cuda_graph_impl),
            ("vision_cuda_graph_impl", m.vision_cuda_graph_impl),
        )
        if value is not CudaGraphImpl.none
    ]


@CONFIG_RULES.rule(
    "megatron.pipeline_parallel", "megatron", "Energon packing in Megatron-Bridge needs PP 1"
)
def _pipeline_parallel(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None
    pp = cfg.train.parallel.pipeline_parallel
    if pp == 1:
        return []
    return [
        error(
            "train.parallel.pipeline_parallel",
            f"train.parallel.pipeline_parallel is {pp}: Megatron-Bridge rejects pipeline "
            "parallelism with Energon packing",
            "set train.parallel.pipeline_parallel=1 (split the model with TP or EP instead; "
            "or train.backend=local, whose pipeline stages carry the packing metadata)",
        )
    ]


SUPPORTED_TASK_ENCODERS = ("QwenVLEnergonTaskEncoderConfig",)


@CONFIG_RULES.rule(
    "megatron.task_encoder",
    "megatron",
    "Energon packing in Megatron-Bridge needs its Qwen-VL task encoder",
)
def _task_encoder(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None
    name = cfg.megatron.task_encoder
    if name in SUPPORTED_TASK_ENCODERS:
        return []
    return [
        error(
            "megatron.task_encoder",
            f"megatron.task_encoder is {name!r}: Megatron-Bridge packs online only with "
            + ", ".join(SUPPORTED_TASK_ENCODERS),
            f"set megatron.task_encoder={SUPPORTED_TASK_ENCODERS[0]}",
        )
    ]


@CONFIG_RULES.rule(
    "megatron.ep_comm_overlap",
    "megatron",
    "Megatron-Bridge turns EP communication overlap off with packing",
)
def _ep_comm_overlap(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None
    if not cfg.megatron.overlap_moe_expert_parallel_comm:
        return []
    return [
        warning(
            "megatron.overlap_moe_expert_parallel_comm",
            "megatron.overlap_moe_expert_parallel_comm is true: Megatron-Bridge forces it "
            "off with packing, so the run will not overlap the EP all-to-all",
            "set megatron.overlap_moe_expert_parallel_comm=false",
        )
    ]


@CONFIG_RULES.rule(
    "megatron.delay_wgrad",
    "megatron",
    "Megatron-Bridge turns delayed weight-gradient compute off with packing",
)
def _delay_wgrad(cfg: PipelineConfig) -> list[Issue] | None:
    if not _megatron_packed(cfg):
        return None
    if not cfg.megatron.delay_wgrad_compute:
        return []
    return [
        warning(
            "megatron.delay_wgrad_compute",
            "megatron.delay_wgrad_compute is true: Megatron-Bridge forces it off with packing",
            "set megatron.delay_wgrad_compute=false",
        )
    ]


# --- what packline refuses to touch (schemas/safety.py) -------------------------------------


@CONFIG_RULES.rule(
    "config.shell_safe",
    "config",
    "no value that reaches a shell or SLURM command line holds shell syntax or whitespace",
)
def _shell_safe(cfg: PipelineConfig) -> list[Issue]:
    from schemas.safety import shell_problems

    return [error(*found) for found in shell_problems(cfg.to_dict(), cfg.work_path)]


@CONFIG_RULES.rule(
    "config.data_placement",
    "config",
    "no input lies in a dir a run replaces, and the work dir is outside the data",
)
def _data_placement(cfg: PipelineConfig) -> list[Issue]:
    from schemas.safety import data_placement_problems

    return [error(*found) for found in data_placement_problems(cfg.work_path, STAGES, cfg.inputs())]


def config_findings(cfg: PipelineConfig) -> list[Finding]:
    """What the cross-section guardrails find in ``cfg`` (errors and warnings)."""
    return CONFIG_RULES.run(cfg)[0]


# --- SLURM (executor.kind: slurm) -----------------------------------------------------------

SLURM_RULES = RuleBook()


def train_nproc_per_node(cfg: PipelineConfig) -> int:
    """torchrun processes per node of the SLURM train job: ``nproc_per_node``, else one per
    GPU."""
    s = cfg.executor.slurm
    return s.nproc_per_node or max(s.gpus_per_node, 1)


def train_world(cfg: PipelineConfig) -> int:
    """Ranks of a local-backend train run: the SLURM train job's ``nodes ×
    nproc_per_node``, else ``train.nproc_per_node`` (torchrun on this machine)."""
    if cfg.executor.kind is ExecutorKind.slurm:
        return cfg.executor.slurm.nodes * train_nproc_per_node(cfg)
    return cfg.train.nproc_per_node


def layout_issues(cfg: PipelineConfig, *, setting: str) -> list[Issue]:
    """Why ``train.parallel`` cannot run on the train run's ranks (:func:`train_world`), one
    error each: the ranks, rows and stages must split evenly, and the combination must be
    one the engines run (``schemas.layout.ParallelLayout.problems``). Fixed width and
    the micro-batch have their own packing rules; the model's layers and experts are checked
    by validate's model rules, which read the model's config."""
    from schemas.layout import ParallelLayout

    par, world = cfg.train.parallel, train_world(cfg)
    found = ParallelLayout.from_config(par, world).problems(
        rows_per_step=cfg.train.global_batch_size,
        packed_only=not cfg.train.compare_packing and cfg.packing.enabled,
    )
    if par.pipeline_parallel > 1 and cfg.train.moe_aux_loss_coef > 0:
        found.append(
            f"moe_aux_loss_coef {cfg.train.moe_aux_loss_coef} with pipeline_parallel > 1: the "
            "load-balancing loss needs every layer's routing of a micro-batch at once (it "
            "is still logged; set train.moe_aux_loss_coef=0)"
        )
    if cfg.executor.kind is ExecutorKind.slurm:
        s = cfg.executor.slurm
        nproc = train_nproc_per_node(cfg)
        where = f"the SLURM train job's {world} ranks: nodes {s.nodes} × nproc_per_node {nproc}"
    else:
        where = f"train.nproc_per_node {world}"
    return [
        error(
            setting,
            f"train.parallel: {problem} ({where}; pipeline_parallel {par.pipeline_parallel}, "
            f"expert_parallel {par.expert_parallel})",
            f"change train.parallel, {setting} or train.global_batch_size "
            "(README: parallel layouts)",
        )
        for problem in found
    ]


@CONFIG_RULES.rule(
    "train.parallel",
    "train",
    "the local backend's layout splits this machine's ranks, rows and stages evenly",
)
def _local_layout(cfg: PipelineConfig) -> list[Issue] | None:
    if cfg.train.backend is not TrainBackend.local or cfg.executor.kind is ExecutorKind.slurm:
        return None  # on SLURM: slurm.parallel; Bridge splits its GPUs (megatron_overrides.py)
    return layout_issues(cfg, setting="train.nproc_per_node")


@SLURM_RULES.rule(
    "slurm.parallel",
    "slurm",
    "with train.backend local, the train job's ranks fit train.parallel and the batch",
)
def _slurm_layout(cfg: PipelineConfig) -> list[Issue] | None:
    if cfg.executor.kind is not ExecutorKind.slurm or cfg.train.backend is not TrainBackend.local:
        return None  # the Megatron rules split Bridge's GPUs (packline/megatron/overrides.py)
    return layout_issues(cfg, setting="executor.slurm.nproc_per_node")
