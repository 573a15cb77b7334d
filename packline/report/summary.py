"""One training run's figures (:class:`RunSummary`) and packing on against off
(:class:`PackingComparison`), each computed once, from the run's records.

A *step record* is one optimizer step: ``step`` and metric names of
:mod:`packline.metrics` to their values (a line of ``metrics.jsonl``). An *eval record* is
one evaluation: ``step``, ``eval/loss``, ``eval/accuracy``, ``eval/questions`` and,
where the source has it, ``by_kind`` (a line of ``eval.jsonl``). The MLflow reader
(:mod:`packline.report.mlflow_store`) builds the same records from metric histories, so
:func:`summarize_run` is the only place that sums a run's figures, whichever the source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from packline import metrics as M

RUNS = ("packed", "unpacked")
SPEEDUP_TARGET = 2.0
"""``bench train``'s target: packed real tokens/s at least this times unpacked."""

STEP_INPUTS = (
    M.TRAIN_LOSS,
    M.TRAIN_STEP_SECONDS,
    M.TRAIN_CPU_SECONDS,
    M.TRAIN_DATA_SECONDS,
    M.TRAIN_VISION_SECONDS,
    M.TRAIN_TOKENS_REAL,
    M.TRAIN_PADDED_TOKENS,
    M.TRAIN_CONVERSATIONS,
    M.TRAIN_FLOPS_USEFUL,
    M.TRAIN_FLOPS_EXECUTED,
    M.PACK_ROWS,
)
"""The metrics :func:`summarize_run` reads from every step record."""
EVAL_INPUTS = (M.EVAL_LOSS, M.EVAL_TOKEN_ACCURACY, M.EVAL_ACCURACY, M.EVAL_QUESTIONS)
"""The metrics :func:`summarize_run` reads from every eval record."""
WINDOWS = 8
"""Windows a run's steps are split into for the spread of its throughput (unless told)."""


@dataclass(kw_only=True)
class EvalPoint:
    """One evaluation of a run, placed on its training time."""

    step: int
    """Optimizer steps done when it ran (0: before the first)."""
    train_seconds: float
    """Σ ``train/step_seconds`` of the steps up to ``step`` (evaluations excluded)."""
    loss: float
    accuracy: float


@dataclass(kw_only=True)
class RunSummary:
    """The figures of one training run (packing on or off); ``to_dict`` is its
    ``result.json``."""

    run: str
    """``packed`` or ``unpacked``."""
    steps: int
    """Optimizer steps in the records (a resumed MLflow run holds only the steps after the
    checkpoint it resumed from: then ``first_step`` > 1)."""
    first_step: int
    last_step: int
    ranks: int
    """Data-parallel ranks the run trained on."""
    precision: str
    """What ``train.precision`` resolved to (``bf16`` / ``fp32``)."""
    seq_length: int
    """Capacity of a row in tokens (``packing.seq_length``)."""
    real_tokens: int
    """Σ ``train/tokens_real``: the conversations' own tokens."""
    padded_tokens: int
    """Σ ``train/padded_tokens``: tokens executed that are padding."""
    train_seconds: float
    """Σ ``train/step_seconds``: time in optimizer steps (evaluation and checkpoints out)."""
    data_seconds: float
    """Of ``train_seconds``: waiting for rows (the same work packed or not; rank 0)."""
    vision_seconds: float
    """Of ``train_seconds``: vision tower forwards (the same work packed or not; rank 0)."""
    real_tokens_per_s: float
    """``real_tokens`` / ``train_seconds``."""
    cpu_seconds: float
    """Σ ``train/cpu_seconds``: CPU time of the steps, every thread of every rank."""
    real_tokens_per_cpu_s: float
    """``real_tokens`` / ``cpu_seconds``: throughput per CPU-second, which load beside the
    run does not dilute the way it dilutes wall-clock throughput."""
    window_steps: int
    """Steps per window of :attr:`window_tokens_per_s` (the last window may be shorter)."""
    window_tokens_per_s: list[float]
    """Real tokens/s of each window of ``window_steps`` consecutive steps, in step order."""
    window_tokens_per_cpu_s: list[float]
    """Real tokens per CPU-second of each window."""
    padding_fraction: float
    """``padded_tokens`` / (real + padded): the executed tokens that are padding."""
    fill: float
    """Σ real / (Σ ``pack/rows`` × ``seq_length``): equals the mean row fill."""
    conversations_per_row: float
    """Σ ``train/conversations`` / Σ ``pack/rows`` (1 when packing is off)."""
    final_train_loss: float
    """``train/loss`` of the last step."""
    eval_loss_start: float | None
    """Eval loss before the first step (None: the records start after a resume)."""
    eval_loss: float | None
    """Eval loss of the last evaluation (None: never evaluated)."""
    eval_token_accuracy_start: float | None
    """Share of the val target tokens predicted right (teacher-forced), before the first step."""
    eval_token_accuracy: float | None
    eval_accuracy_start: float | None
    eval_accuracy: float | None
    eval_accuracy_chance: float | None
    """Accuracy of guessing among each question kind's answers, on the same questions."""
    eval_questions: int
    """Questions asked at the last evaluation."""
    eval_by_kind: dict[str, dict[str, Any]] | None
    """Per question kind at the last evaluation: ``{questions, accuracy, chance}`` (None
    where the source lacks it)."""
    tflops_useful: float
    """Σ ``train/flops_useful`` / 1e12: exact FLOPs over the real tokens."""
    tflops_executed: float
    """Σ ``train/flops_executed`` / 1e12: exact FLOPs of the layout as run."""
    tflops_per_s: float
    """``tflops_useful`` / ``train_seconds``."""
    wall_seconds: float | None
    """Start to end of the run, evaluation and checkpoints included (None: unknown)."""
    run_id: str | None
    """The MLflow run (None outside MLflow)."""
    ran: dict[str, str] = field(default_factory=dict)
    """What trained (:meth:`packline.train.trainer.Trainer.what_ran`): the attention kernel
    ``model.attention`` chose, the base's and the adapters' dtypes, activation checkpointing
    and the sharding."""
    evals: list[EvalPoint] = field(default_factory=list)
    """Every evaluation in step order (for the seconds to reach an eval loss)."""

    @property
    def window_spread(self) -> tuple[float, float]:
        """(min, max) real tokens/s over the windows."""
        w = self.window_tokens_per_s
        return (min(w), max(w)) if w else (math.nan, math.nan)

    @property
    def other_seconds(self) -> float:
        """Of ``train_seconds``: neither data nor vision (language model, optimizer)."""
        return self.train_seconds - self.data_seconds - self.vision_seconds

    def seconds_to_eval_loss(self, target: float) -> float | None:
        """Training seconds until the first evaluation at or below ``target`` (None:
        never)."""
        return next((e.train_seconds for e in self.evals if e.loss <= target + 1e-12), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSummary:
        """The inverse of :meth:`to_dict`; ``ValueError`` naming the keys that differ."""
        names = {f.name for f in fields(cls)}
        missing, unknown = sorted(names - set(d)), sorted(set(d) - names)
        if missing or unknown:
            raise ValueError(
                f"not a run summary: missing keys {missing}, unknown keys {unknown} "
                "(written by RunSummary.to_dict of this packline?)"
            )
        return cls(**{**d, "evals": [EvalPoint(**e) for e in d["evals"]]})


def _missing(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[str]:
    return sorted({n for r in records for n in names if n not in r})


def summarize_run(
    steps: Sequence[Mapping[str, Any]],
    evals: Sequence[Mapping[str, Any]],
    *,
    run: str,
    seq_length: int,
    precision: str,
    ranks: int = 1,
    chance: float | None = None,
    chance_by_kind: Mapping[str, float] | None = None,
    wall_seconds: float | None = None,
    run_id: str | None = None,
    ran: Mapping[str, str] | None = None,
    window_steps: int | None = None,
) -> RunSummary:
    """The summary of one run from its step and eval records (each in any order, one
    record per step) and the facts the records do not carry. Its throughput is given per
    window of ``window_steps`` consecutive steps too (default: :data:`WINDOWS` windows).

    ``ValueError`` when a record lacks a metric the summary reads (:data:`STEP_INPUTS`,
    :data:`EVAL_INPUTS`): a renamed metric fails here instead of counting as zero.

    >>> def step(n, real, padded, seconds):
    ...     return {"step": n, M.TRAIN_LOSS: 3.0 - n, M.TRAIN_STEP_SECONDS: seconds,
    ...             M.TRAIN_CPU_SECONDS: 2 * seconds, M.TRAIN_DATA_SECONDS: 0.5,
    ...             M.TRAIN_VISION_SECONDS: 0.5,
    ...             M.TRAIN_TOKENS_REAL: real, M.TRAIN_PADDED_TOKENS: padded,
    ...             M.TRAIN_CONVERSATIONS: 4, M.TRAIN_FLOPS_USEFUL: 1e12,
    ...             M.TRAIN_FLOPS_EXECUTED: 2e12, M.PACK_ROWS: 2}
    >>> def ev(n, loss, tokens, accuracy):
    ...     return {"step": n, M.EVAL_LOSS: loss, M.EVAL_TOKEN_ACCURACY: tokens,
    ...             M.EVAL_ACCURACY: accuracy, M.EVAL_QUESTIONS: 2}
    >>> evals = [ev(0, 8.0, 0.1, 0.0),
    ...          {**ev(2, 6.0, 0.4, 0.5),
    ...           "by_kind": {"count": {"questions": 2, "accuracy": 0.5}}}]
    >>> s = summarize_run([step(1, 3000, 0, 2.0), step(2, 3144, 0, 2.0)], evals,
    ...                   run="packed", seq_length=2048, precision="fp32",
    ...                   chance=0.25, chance_by_kind={"count": 0.25})
    >>> s.real_tokens, s.real_tokens_per_s, s.fill, s.conversations_per_row, s.other_seconds
    (6144, 1536.0, 0.75, 2.0, 2.0)
    >>> s.real_tokens_per_cpu_s, s.window_steps, s.window_tokens_per_s
    (768.0, 1, [1500.0, 1572.0])
    >>> (s.eval_loss_start, s.eval_loss), (s.eval_token_accuracy_start, s.eval_token_accuracy)
    ((8.0, 6.0), (0.1, 0.4))
    >>> s.eval_by_kind, s.seconds_to_eval_loss(6.0)
    ({'count': {'questions': 2, 'accuracy': 0.5, 'chance': 0.25}}, 4.0)
    """
    if run not in RUNS:
        raise ValueError(f"run {run!r} must be one of {RUNS}")
    if not steps:
        raise ValueError(f"the {run} run has no step records (did it train a step?)")
    for what, records, names in (("step", steps, STEP_INPUTS), ("eval", evals, EVAL_INPUTS)):
        if missing := _missing(records, names):
            raise ValueError(
                f"{what} records of the {run} run lack {missing}: the train stage logs other "
                "names than packline.metrics (or a run older than them)"
            )
    steps = sorted(steps, key=lambda s: s["step"])
    evals = sorted(evals, key=lambda e: e["step"])

    def total(name: str) -> float:
        return sum(s[name] for s in steps)

    real, padded = total(M.TRAIN_TOKENS_REAL), total(M.TRAIN_PADDED_TOKENS)
    rows, seconds = total(M.PACK_ROWS), total(M.TRAIN_STEP_SECONDS)
    elapsed = [(steps[0]["step"] - 1, 0.0)]  # (step, Σ step seconds up to it)
    for s in steps:
        elapsed.append((s["step"], elapsed[-1][1] + s[M.TRAIN_STEP_SECONDS]))
    points = [
        EvalPoint(
            step=e["step"],
            train_seconds=max((t for st, t in elapsed if st <= e["step"]), default=0.0),
            loss=e[M.EVAL_LOSS],
            accuracy=e[M.EVAL_ACCURACY],
        )
        for e in evals
    ]
    start = next((e for e in evals if e["step"] == 0), None)
    last = evals[-1] if evals else None
    by_kind = None
    if last is not None and last.get(M.EVAL_BY_KIND) is not None:
        chances = chance_by_kind or {}
        by_kind = {
            kind: {
                "questions": int(v["questions"]),
                "accuracy": v["accuracy"],
                "chance": chances.get(kind),
            }
            for kind, v in last[M.EVAL_BY_KIND].items()
        }
    useful = total(M.TRAIN_FLOPS_USEFUL) / 1e12
    cpu = total(M.TRAIN_CPU_SECONDS)
    per = window_steps or max(1, math.ceil(len(steps) / WINDOWS))
    windows = [steps[i : i + per] for i in range(0, len(steps), per)]

    def rate(window: Sequence[Mapping[str, Any]], seconds: str) -> float:
        spent = sum(s[seconds] for s in window)
        return sum(s[M.TRAIN_TOKENS_REAL] for s in window) / spent if spent else math.nan

    return RunSummary(
        run=run,
        steps=len(steps),
        first_step=steps[0]["step"],
        last_step=steps[-1]["step"],
        ranks=ranks,
        precision=precision,
        seq_length=seq_length,
        real_tokens=int(real),
        padded_tokens=int(padded),
        train_seconds=seconds,
        data_seconds=total(M.TRAIN_DATA_SECONDS),
        vision_seconds=total(M.TRAIN_VISION_SECONDS),
        real_tokens_per_s=real / seconds if seconds else 0.0,
        cpu_seconds=cpu,
        real_tokens_per_cpu_s=real / cpu if cpu else 0.0,
        window_steps=per,
        window_tokens_per_s=[rate(w, M.TRAIN_STEP_SECONDS) for w in windows],
        window_tokens_per_cpu_s=[rate(w, M.TRAIN_CPU_SECONDS) for w in windows],
        padding_fraction=padded / (real + padded) if real + padded else 0.0,
        fill=real / (rows * seq_length) if rows else 0.0,
        conversations_per_row=total(M.TRAIN_CONVERSATIONS) / rows if rows else 0.0,
        final_train_loss=steps[-1][M.TRAIN_LOSS],
        eval_loss_start=start[M.EVAL_LOSS] if start else None,
        eval_loss=last[M.EVAL_LOSS] if last else None,
        eval_token_accuracy_start=start[M.EVAL_TOKEN_ACCURACY] if start else None,
        eval_token_accuracy=last[M.EVAL_TOKEN_ACCURACY] if last else None,
        eval_accuracy_start=start[M.EVAL_ACCURACY] if start else None,
        eval_accuracy=last[M.EVAL_ACCURACY] if last else None,
        eval_accuracy_chance=chance,
        eval_questions=int(last[M.EVAL_QUESTIONS]) if last else 0,
        eval_by_kind=by_kind,
        tflops_useful=useful,
        tflops_executed=total(M.TRAIN_FLOPS_EXECUTED) / 1e12,
        tflops_per_s=useful / seconds if seconds else 0.0,
        wall_seconds=wall_seconds,
        run_id=run_id,
        ran=dict(ran or {}),
        evals=points,
    )


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


@dataclass(frozen=True, kw_only=True)
class Target:
    """One of ``bench train``'s targets, checked on a comparison."""

    held: bool
    value: float
    rule: str


@dataclass(kw_only=True)
class PackingComparison:
    """Packing on against off, on the same conversations per optimizer step. Ratios whose
    denominator is 0 are nan."""

    packed: RunSummary
    unpacked: RunSummary

    def __post_init__(self) -> None:
        if (self.packed.run, self.unpacked.run) != RUNS:
            raise ValueError(
                f"a comparison is of a packed and an unpacked run, not "
                f"{self.packed.run!r} and {self.unpacked.run!r}"
            )

    @classmethod
    def of(cls, runs: Sequence[RunSummary]) -> PackingComparison:
        """The comparison of a packed and an unpacked summary, in either order."""
        by_name = {r.run: r for r in runs}
        if len(runs) != 2 or set(by_name) != set(RUNS):
            raise ValueError(f"need one packed and one unpacked run, got {[r.run for r in runs]}")
        return cls(packed=by_name["packed"], unpacked=by_name["unpacked"])

    @property
    def runs(self) -> tuple[RunSummary, RunSummary]:
        return self.packed, self.unpacked

    @property
    def speedup(self) -> float:
        """Real tokens/s packed ÷ unpacked."""
        return _div(self.packed.real_tokens_per_s, self.unpacked.real_tokens_per_s)

    @property
    def speedup_per_cpu_s(self) -> float:
        """Real tokens per CPU-second packed ÷ unpacked: the speedup load beside the runs
        leaves alone (it takes wall time from both, CPU time from neither)."""
        return _div(self.packed.real_tokens_per_cpu_s, self.unpacked.real_tokens_per_cpu_s)

    def window_speedups(self, per_cpu_s: bool = False) -> list[float]:
        """Packed ÷ unpacked real tokens/s (or per CPU-second) window by window: the same
        conversations in both (the same steps). Interleaved windows (``packline bench
        train``) ran side by side in time, so load that comes and goes lands on both."""
        on, off = (
            (r.window_tokens_per_cpu_s if per_cpu_s else r.window_tokens_per_s) for r in self.runs
        )
        if self.packed.window_steps != self.unpacked.window_steps:
            return []
        return [_div(a, b) for a, b in zip(on, off, strict=False)]

    @property
    def speedup_without_data(self) -> float:
        """Unpacked ÷ packed train seconds with the data wait taken out: what a machine
        sees whose loader workers keep up on cores of their own."""
        on, off = self.runs
        return _div(off.train_seconds - off.data_seconds, on.train_seconds - on.data_seconds)

    @property
    def speedup_without_data_and_vision(self) -> float:
        """Unpacked ÷ packed seconds of what packing changes: the language model's forward
        and backward, and the optimizer."""
        return _div(self.unpacked.other_seconds, self.packed.other_seconds)

    @property
    def flops_executed_ratio(self) -> float:
        """Executed FLOPs unpacked ÷ packed (padding included): the speedup of a device
        whose time follows FLOPs."""
        return _div(self.unpacked.tflops_executed, self.packed.tflops_executed)

    @property
    def target_eval_loss(self) -> float | None:
        """The higher of the two final eval losses: the loss both runs reach."""
        losses = [r.eval_loss for r in self.runs]
        return None if None in losses else max(losses)

    @property
    def seconds_to_eval_loss(self) -> dict[str, float | None]:
        """Per run: training seconds until its eval loss first reaches
        :attr:`target_eval_loss`."""
        target = self.target_eval_loss
        return {
            r.run: None if target is None else r.seconds_to_eval_loss(target) for r in self.runs
        }

    @property
    def seconds_to_eval_loss_ratio(self) -> float | None:
        """Unpacked ÷ packed seconds to the same eval loss (None: one never reached it)."""
        reach = self.seconds_to_eval_loss
        if not (reach["packed"] and reach["unpacked"]):
            return None
        return reach["unpacked"] / reach["packed"]

    def targets(self) -> dict[str, Target]:
        """``bench train``'s targets: speedup ≥ :data:`SPEEDUP_TARGET` with equal accuracy
        (both train the same conversations per step)."""
        on, off = self.packed.eval_accuracy, self.unpacked.eval_accuracy
        equal = on is not None and off is not None
        return {
            "speedup": Target(
                held=self.speedup >= SPEEDUP_TARGET,
                value=self.speedup,
                rule=f">= {SPEEDUP_TARGET:g}x real tokens/s",
            ),
            "equal_accuracy": Target(
                held=equal and on == off,
                value=on - off if equal else math.nan,
                rule="packed - unpacked eval accuracy == 0 (same conversations per step)",
            ),
        }

    def ratios(self) -> dict[str, Any]:
        """The pair's own figures, by name."""
        return {
            "speedup_real_tokens_per_s": self.speedup,
            "speedup_per_cpu_s": self.speedup_per_cpu_s,
            "window_speedups": self.window_speedups(),
            "window_speedups_per_cpu_s": self.window_speedups(per_cpu_s=True),
            "speedup_without_data": self.speedup_without_data,
            "speedup_without_data_and_vision": self.speedup_without_data_and_vision,
            "flops_executed_ratio": self.flops_executed_ratio,
            "target_eval_loss": self.target_eval_loss,
            "seconds_to_eval_loss": self.seconds_to_eval_loss,
            "seconds_to_eval_loss_ratio": self.seconds_to_eval_loss_ratio,
        }

    def side_by_side(self) -> dict[str, Any]:
        """``bench train --json``: each run figure as ``{packed: ..., unpacked: ...}``, then
        the ratios and the targets."""
        per_run = (
            "real_tokens_per_s",
            "real_tokens_per_cpu_s",
            "window_tokens_per_s",
            "window_tokens_per_cpu_s",
            "cpu_seconds",
            "train_seconds",
            "real_tokens",
            "padded_tokens",
            "eval_loss",
            "eval_token_accuracy",
            "eval_accuracy",
            "eval_questions",
            "eval_by_kind",
            "data_seconds",
            "vision_seconds",
            "other_seconds",
            "tflops_executed",
        )
        out: dict[str, Any] = {k: {r.run: getattr(r, k) for r in self.runs} for k in per_run}
        out["target_eval_loss"] = self.target_eval_loss
        out["seconds_to_eval_loss"] = self.seconds_to_eval_loss
        out["speedup"] = self.speedup
        out["speedup_per_cpu_s"] = self.speedup_per_cpu_s
        out["window_speedups"] = self.window_speedups()
        out["window_speedups_per_cpu_s"] = self.window_speedups(per_cpu_s=True)
        for k in ("speedup_without_data", "speedup_without_data_and_vision"):
            out[k] = getattr(self, k)
        out["flops_executed_ratio"] = self.flops_executed_ratio
        if self.seconds_to_eval_loss_ratio is not None:
            out["seconds_to_eval_loss_ratio"] = self.seconds_to_eval_loss_ratio
        out["targets"] = {name: asdict(t) for name, t in self.targets().items()}
        return out


COMPARISON = "comparison.json"
"""The train stage's file of :func:`comparison_record`, in its stage dir."""


def comparison_record(runs: Sequence[RunSummary]) -> dict[str, Any]:
    """The train stage's ``comparison.json``: every run's summary and, for a pair, the
    speedup."""
    out: dict[str, Any] = {"runs": [r.to_dict() for r in runs]}
    if len(runs) == 2:
        out["speedup_real_tokens_per_s"] = PackingComparison.of(runs).speedup
    return out


def compare_metrics(runs: Sequence[RunSummary]) -> dict[str, float]:
    """The train stage run's own ``compare/*`` metrics: :data:`packline.metrics.COMPARE_FIGURES`
    of each run and, for a pair, the speedups (wall-clock and per CPU-second)."""
    out = {
        M.compare(r.run, figure): float(getattr(r, figure))
        for r in runs
        for figure in M.COMPARE_FIGURES
        if getattr(r, figure) is not None
    }
    if len(runs) == 2:
        pair = PackingComparison.of(runs)
        out[M.COMPARE_SPEEDUP_REAL_TOKENS_PER_S] = pair.speedup
        out[M.COMPARE_SPEEDUP_PER_CPU_S] = pair.speedup_per_cpu_s
    return out
