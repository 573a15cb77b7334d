"""Cross-section rules of a resolved config: the packing rules, and the SLURM rules.

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
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from schemas.choices import STAGES, ExecutorKind, LossWeighting, TrainBackend

if TYPE_CHECKING:  # annotations only: schemas/config.py imports this module to apply the rules
    from schemas.config import PipelineConfig

Severity = Literal["error", "warning"]
Status = Literal["ok", "error", "warning", "not applicable"]


@dataclass(frozen=True)
class Finding:
    """One broken rule: the setting to change, the rule, what is wrong, and the fix. A rule
    function makes its findings with :func:`error` and :func:`warning`; the book that runs it
    fills in ``rule`` and ``requires``."""

    severity: Severity
    setting: str
    """The dotted config key to change (or the table / file at fault)."""
    message: str
    """What is wrong, with the values found."""
    fix: str
    """What to set or run instead."""
    rule: str = ""
    """Id of the rule, e.g. ``packing.micro_batch``."""
    requires: str = ""
    """What the rule requires, in one line."""

    @property
    def text(self) -> str:
        """The finding as one line of a ``UserError``."""
        return f"{self.message}; fix: {self.fix}"

    def to_dict(self) -> dict[str, str]:
        keys = ("rule", "requires", "severity", "setting", "message", "fix")
        return {k: getattr(self, k) for k in keys}


def error(setting: str, message: str, fix: str) -> Finding:
    return Finding("error", setting, message, fix)


def warning(setting: str, message: str, fix: str) -> Finding:
    return Finding("warning", setting, message, fix)


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
    fn: Callable[..., list[Finding] | None]
    """Returns the broken rule's findings ([] when it holds), or None when it does not apply."""


@dataclass
class RuleBook:
    """An ordered list of rules of one kind; a rule is a function registered with
    :meth:`rule` that takes the book's arguments."""

    rules: list[Rule] = field(default_factory=list)

    def rule(self, id: str, group: str, requires: str):
        def register(fn: Callable[..., list[Finding] | None]):
            self.rules.append(Rule(id, group, requires, fn))
            return fn

        return register

    def run(self, *args: Any) -> tuple[list[Finding], list[Check]]:
        """Every rule of the book on ``args``: what broke, and each rule's status."""
        findings: list[Finding] = []
        checks: list[Check] = []
        for r in self.rules:
            made = r.fn(*args)
            found = [replace(f, rule=r.id, requires=r.requires) for f in made or []]
            findings += found
            status: Status = "not applicable" if made is None else "ok"
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
def _micro_batch(cfg: PipelineConfig) -> list[Finding] | None:
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


class BridgePackingGuard(NamedTuple):
    """One of Megatron-Bridge's native-packing guardrails on a ``ConfigContainer`` key that
    packline sends from one of its settings. The one home of each: the config rule (its id
    ``rule``) checks packline's setting; the Megatron rule on ``megatron.extra_overrides``
    (``packline/rules/megatron.py``) checks an extra override of ``key``, which Bridge gets
    instead."""

    rule: str
    requires: str
    """What the rule requires, in one line (the report's)."""
    setting: str
    """packline's setting that sends the value."""
    key: str
    """Bridge's dotted ConfigContainer key."""
    key_requires: str
    """What Bridge needs of the key's value, as the extra-override rule says it."""
    holds: Callable[[Any], bool]
    """Whether a plain value (an enum's value, a bool, an int) keeps the guardrail."""
    why: str
    """What goes wrong otherwise (the config rule's message, after the value)."""
    fix: str
    severity: Severity = "error"


_CUDA_GRAPHS = (
    "CUDA graphs replay fixed shapes and packed rows change shape every step, so "
    "Megatron-Bridge rejects them with packing"
)
_PACKING_REQUIRES = "Energon packing in Megatron-Bridge needs"
#: Bridge's native-packing guardrails, in the order the config rules run.
BRIDGE_PACKING_GUARDS = (
    BridgePackingGuard(
        "packing.per_token_loss",
        "packing needs a per-token loss (token losses / loss tokens of the global batch)",
        "megatron.calculate_per_token_loss",
        "model.calculate_per_token_loss",
        "true (a per-token loss)",
        lambda v: v is True,
        "a per-sequence mean weighs the conversations of a packed row by how they were packed",
        "set megatron.calculate_per_token_loss=true",
    ),
    BridgePackingGuard(
        "packing.no_collective_average",
        "packing needs gradients summed, not averaged, in the data-parallel all-reduce",
        "megatron.average_in_collective",
        "ddp.average_in_collective",
        "false (gradients summed)",
        lambda v: v is False,
        "averaging in the all-reduce divides the already globally normalized per-token loss "
        "by the DP size again",
        "set megatron.average_in_collective=false",
    ),
    BridgePackingGuard(
        "megatron.mtp",
        f"{_PACKING_REQUIRES} MTP off",
        "megatron.mtp_num_layers",
        "model.mtp_num_layers",
        "0 (no MTP)",
        lambda v: not v,
        "Megatron-Bridge rejects multi-token prediction with packed sequences",
        "set megatron.mtp_num_layers=0",
    ),
    BridgePackingGuard(
        "megatron.cuda_graphs",
        f"{_PACKING_REQUIRES} CUDA graphs off",
        "megatron.cuda_graph_impl",
        "model.cuda_graph_impl",
        '"none" (no CUDA graphs)',
        lambda v: v in (None, "none"),
        _CUDA_GRAPHS,
        "set megatron.cuda_graph_impl=none",
    ),
    BridgePackingGuard(
        "megatron.cuda_graphs",
        f"{_PACKING_REQUIRES} CUDA graphs off",
        "megatron.vision_cuda_graph_impl",
        "model.vision_cuda_graph_impl",
        '"none" (no CUDA graphs)',
        lambda v: v in (None, "none"),
        _CUDA_GRAPHS,
        "set megatron.vision_cuda_graph_impl=none",
    ),
    BridgePackingGuard(
        "megatron.pipeline_parallel",
        f"{_PACKING_REQUIRES} PP 1",
        "train.parallel.pipeline_parallel",
        "model.pipeline_model_parallel_size",
        "1 (no pipeline parallelism)",
        lambda v: (v or 1) == 1,
        "Megatron-Bridge rejects pipeline parallelism with Energon packing",
        "set train.parallel.pipeline_parallel=1 (split the model with TP or EP instead; "
        "or train.backend=local, whose pipeline stages carry the packing metadata)",
    ),
    BridgePackingGuard(
        "megatron.ep_comm_overlap",
        "Megatron-Bridge turns EP communication overlap off with packing",
        "megatron.overlap_moe_expert_parallel_comm",
        "model.overlap_moe_expert_parallel_comm",
        "false (Bridge turns it off)",
        lambda v: not v,
        "Megatron-Bridge forces it off with packing, so the run will not overlap the EP all-to-all",
        "set megatron.overlap_moe_expert_parallel_comm=false",
        "warning",
    ),
    BridgePackingGuard(
        "megatron.delay_wgrad",
        "Megatron-Bridge turns delayed weight-gradient compute off with packing",
        "megatron.delay_wgrad_compute",
        "model.delay_wgrad_compute",
        "false (Bridge turns it off)",
        lambda v: not v,
        "Megatron-Bridge forces it off with packing",
        "set megatron.delay_wgrad_compute=false",
        "warning",
    ),
)


def _setting_value(cfg: PipelineConfig, setting: str) -> Any:
    """A dotted setting's value, plain (an enum as its value)."""
    value: Any = cfg
    for part in setting.split("."):
        value = getattr(value, part)
    return getattr(value, "value", value)


def _shown(value: Any) -> str:
    """A value as a config message shows it: ``true``, ``2``, ``'full'``."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _register_guards(*rule_ids: str) -> None:
    """One config rule per id, checking every guard of that id on packline's settings."""
    for rule_id in rule_ids:
        guards = [g for g in BRIDGE_PACKING_GUARDS if g.rule == rule_id]
        group = rule_id.split(".")[0]

        def check(cfg: PipelineConfig, guards=guards) -> list[Finding] | None:
            if not _megatron_packed(cfg):
                return None  # the local backend: per-token loss and summed gradients by design
            out = []
            for g in guards:
                value = _setting_value(cfg, g.setting)
                if not g.holds(value):
                    message = f"{g.setting} is {_shown(value)}: {g.why}"
                    out.append(Finding(g.severity, g.setting, message, g.fix))
            return out

        CONFIG_RULES.rule(rule_id, group, guards[0].requires)(check)


_register_guards("packing.per_token_loss", "packing.no_collective_average")


@CONFIG_RULES.rule(
    "packing.fixed_width", "packing", "EP > 1 or PP > 1 needs fixed-width packed rows"
)
def _fixed_width(cfg: PipelineConfig) -> list[Finding] | None:
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


@CONFIG_RULES.rule(
    "megatron.loss_weighting",
    "megatron",
    "Megatron-Bridge trains with train.loss token (main's loss has no per-sample hook)",
)
def _loss_weighting(cfg: PipelineConfig) -> list[Finding] | None:
    if cfg.train.backend is not TrainBackend.megatron:
        return None
    if cfg.train.loss is LossWeighting.token:
        return []
    return [
        error(
            "train.loss",
            "train.loss is sample with train.backend megatron: Megatron-Bridge main's VLM "
            "step builds its loss with create_masked_next_token_loss_function "
            "(training/vlm_step.py forward_step; training/losses.py masked_next_token_loss: "
            "Σ token loss × loss_mask, counted per token) and offers no hook to weigh each "
            "conversation alike",
            "set train.loss=token (the default; packed and unpacked agree), or train with "
            "train.backend=local",
        )
    ]


# --- what the model and processor a config names can take (schemas/facts.py) ---------------


@CONFIG_RULES.rule(
    "packing.context_length",
    "packing",
    "packing.seq_length is within the model's context length (max_position_embeddings)",
)
def _context_length(cfg: PipelineConfig) -> list[Finding] | None:
    from schemas.facts import context_length

    limit = context_length(cfg.model.path)
    if limit is None or cfg.packing.seq_length < 1:
        return None  # no readable config.json: validate's model rules say why
    if cfg.packing.seq_length <= limit:
        return []
    whose = f"{cfg.model.path}/config.json" if cfg.model.path else "the built-in tiny model"
    return [
        error(
            "packing.seq_length",
            f"packing.seq_length {cfg.packing.seq_length:,} exceeds the model's context length "
            f"{limit:,} (max_position_embeddings of {whose}): a row is one sequence to the "
            "model, and positions past its context were never trained",
            f"set packing.seq_length <= {limit}",
        )
    ]


def packer_round_bytes(seq_length: int, buffer_size: int) -> int:
    """Memory of one round of carry-over's fullest-subset search
    (``packline.packing.selection.fullest_subset``): a bit set of the reachable sums, C + 1
    bits, for each of the round's samples and one more.

    >>> packer_round_bytes(4096, 64)
    33345
    """
    return (buffer_size + 1) * ((seq_length + 1 + 7) // 8)


def _physical_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@CONFIG_RULES.rule(
    "packing.memory",
    "packing",
    "one packing round at packing.seq_length fits in this machine's memory",
)
def _packer_memory(cfg: PipelineConfig) -> list[Finding] | None:
    p = cfg.packing
    buffers = [p.packing_buffer_size, *p.forecast_buffer_sizes]
    if p.seq_length < 1 or min(buffers) < 1:
        return None
    buffer = max(buffers)
    need, have = packer_round_bytes(p.seq_length, buffer), _physical_memory()
    if need <= have // 2:
        return []
    gib = 1024**3
    return [
        error(
            "packing.seq_length",
            f"packing.seq_length {p.seq_length:,} with buffers of up to {buffer:,} samples: a "
            f"packing round (connect's forecast, the loader's carry-over) holds a {p.seq_length:,}"
            f"-bit set per sample, {need / gib:,.1f} GiB, more than half of this machine's "
            f"{have / gib:,.1f} GiB",
            "set packing.seq_length to the rows the model trains on (its context length at "
            "most), or smaller packing.packing_buffer_size and packing.forecast_buffer_sizes",
        )
    ]


@CONFIG_RULES.rule(
    "processor.pixel_bounds",
    "processor",
    "the pixel bounds an image is resized within are consistent (the processor's own, or "
    "processor.* in their place)",
)
def _pixel_bounds(cfg: PipelineConfig) -> list[Finding] | None:
    from schemas.facts import ImageBounds

    overrides = cfg.processor.geometry_overrides()
    if any(v < 1 for v in overrides.values()):
        return None  # out of range: the section's own rule says so
    bounds = ImageBounds.of(cfg.processor.path, overrides)
    if bounds is None:
        return None  # no readable image processor config: connect says why
    return [
        error("processor.max_pixels", *problem.split("; fix: ", 1)) for problem in bounds.problems()
    ]


# --- Megatron-Bridge with Energon packing (train.backend: megatron) -------------------------


_register_guards("megatron.mtp", "megatron.cuda_graphs", "megatron.pipeline_parallel")


SUPPORTED_TASK_ENCODERS = ("QwenVLEnergonTaskEncoderConfig",)


@CONFIG_RULES.rule(
    "megatron.task_encoder",
    "megatron",
    "Energon packing in Megatron-Bridge needs its Qwen-VL task encoder",
)
def _task_encoder(cfg: PipelineConfig) -> list[Finding] | None:
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


_register_guards("megatron.ep_comm_overlap", "megatron.delay_wgrad")


# --- what packline refuses to touch (schemas/safety.py) -------------------------------------


@CONFIG_RULES.rule(
    "config.shell_safe",
    "config",
    "no value that reaches a shell or SLURM command line holds shell syntax or whitespace",
)
def _shell_safe(cfg: PipelineConfig) -> list[Finding]:
    from schemas.safety import shell_problems

    return [error(*found) for found in shell_problems(cfg.to_dict(), cfg.work_path)]


@CONFIG_RULES.rule(
    "config.data_placement",
    "config",
    "no input lies in a dir a run replaces, and the work dir is outside the data",
)
def _data_placement(cfg: PipelineConfig) -> list[Finding]:
    from schemas.safety import data_placement_problems

    return [error(*found) for found in data_placement_problems(cfg.work_path, STAGES, cfg.inputs())]


@CONFIG_RULES.rule(
    "config.hub",
    "config",
    "a Hugging Face Hub repo named by model.path or processor.path is in the local cache, "
    "or model.download lets connect fetch it",
)
def _hub(cfg: PipelineConfig) -> list[Finding] | None:
    from schemas.hub import cached, fetch_command, repo_id

    repos = [(k, repo_id(v)) for k, v in (("model.path", cfg.model.path),
                                          ("processor.path", cfg.processor.path))]  # fmt: skip
    repos = [(k, r) for k, r in repos if r is not None]
    if not repos:
        return None
    if cfg.model.download:
        return []  # connect fetches what the cache lacks
    return [
        error(
            key,
            f"{key} {repo} is not in the local Hugging Face cache (HF_HOME), and packline "
            "downloads nothing unless told to",
            f"run `{fetch_command(repo)}`, or set model.download=true",
        )
        for key, repo in repos
        if cached(repo) is None
    ]


@CONFIG_RULES.rule("config.work_dir", "config", "the work dir is a directory, or can be made one")
def _work_dir(cfg: PipelineConfig) -> list[Finding]:
    from schemas.paths import work_dir_problem

    problem = work_dir_problem(cfg.work_path)
    return [] if problem is None else [error("work_dir", *problem.split("; fix: ", 1))]


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


def layout_findings(cfg: PipelineConfig, *, setting: str) -> list[Finding]:
    """Why ``train.parallel`` cannot run on the train run's ranks (:func:`train_world`), one
    error each: the ranks, rows and stages must split evenly, and the combination must be
    one the engines run (``schemas.layout.ParallelLayout.problems``). Fixed width and
    the micro-batch have their own packing rules; the model's layers and experts are checked
    by validate's model rules, which read the model's config."""
    from schemas.layout import ParallelLayout

    par, world = cfg.train.parallel, train_world(cfg)
    if min(world, par.expert_parallel, par.pipeline_parallel, cfg.train.global_batch_size) < 1:
        return []  # a count out of its range: the section's own rule names it
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
            f"change train.parallel, {setting} or train.global_batch_size (docs/parallel.md)",
        )
        for problem in found
    ]


@CONFIG_RULES.rule(
    "train.parallel",
    "train",
    "the local backend's layout splits this machine's ranks, rows and stages evenly",
)
def _local_layout(cfg: PipelineConfig) -> list[Finding] | None:
    if cfg.train.backend is not TrainBackend.local or cfg.executor.kind is ExecutorKind.slurm:
        return None  # on SLURM: slurm.parallel; Bridge splits its GPUs (packline.rules.megatron)
    return layout_findings(cfg, setting="train.nproc_per_node")


@SLURM_RULES.rule(
    "slurm.parallel",
    "slurm",
    "with train.backend local, the train job's ranks fit train.parallel and the batch",
)
def _slurm_layout(cfg: PipelineConfig) -> list[Finding] | None:
    if cfg.executor.kind is not ExecutorKind.slurm or cfg.train.backend is not TrainBackend.local:
        return None  # the Megatron rules split Bridge's GPUs (packline/megatron/overrides.py)
    return layout_findings(cfg, setting="executor.slurm.nproc_per_node")


@SLURM_RULES.rule(
    "slurm.checkout",
    "slurm",
    "packline's checkout lies at a path NeMo-Run can ship through a shell command",
)
def _checkout(cfg: PipelineConfig) -> list[Finding] | None:
    from schemas.paths import PROJECT_ROOT
    from schemas.safety import unsafe_reason

    if cfg.executor.kind is not ExecutorKind.slurm:
        return None
    why = unsafe_reason(str(PROJECT_ROOT))
    if why is None:
        return []
    # NeMo-Run's packager ships the code with `cd <root> && find ... | tar` through a shell
    return [
        error(
            "executor.kind",
            f"packline's checkout {str(PROJECT_ROOT)!r}: {why}: NeMo-Run ships it to each job "
            "through a shell command",
            "move the checkout to a path without whitespace or shell characters",
        )
    ]
