"""The one table of training runs: one or two :class:`RunSummary`, one column per run and,
for packing on against off, a ``packed ÷ unpacked`` column. The train stage, ``packline
compare`` and ``packline bench train`` all print it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

from rich.table import Table

from packline.progress import UNITS, si
from packline.report.summary import PackingComparison, RunSummary, Target


def _num(v: float | None, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return si(v, fmt) if fmt in UNITS else format(v, fmt)


def _start_end(start: float | None, end: float | None, fmt: str) -> str:
    return _num(end, fmt) if start is None else f"{format(start, fmt)} → {_num(end, fmt)}"


def _ratio(on: float | None, off: float | None) -> str:
    if on is None or off is None or off == 0 or math.isnan(on) or math.isnan(off):
        return ""
    return f"{on / off:.2f}x"


def _spread(r: RunSummary) -> str:
    low, high = r.window_spread
    n = len(r.window_tokens_per_s)
    return f"{_num(low, ',.0f')} – {_num(high, ',.0f')} ({n} × {r.window_steps} steps)"


def _median_range(values: Sequence[float]) -> str:
    """``1.23x (1.10x – 1.31x)``: the median of per-window ratios and their range."""
    shown = sorted(v for v in values if not math.isnan(v))
    if not shown:
        return "n/a"
    return f"{statistics.median(shown):.2f}x ({shown[0]:.2f}x – {shown[-1]:.2f}x)"


def _steps(r: RunSummary) -> str:
    return f"{r.steps} (from {r.first_step})" if r.first_step > 1 else str(r.steps)


Row = tuple[str, Callable[[RunSummary], float | str | None], str | None, bool]
"""(label, the run's value, its format (None: already text; a unit of
:data:`packline.progress.UNITS`: the value with an SI prefix and that unit), whether the ratio
column shows packed ÷ unpacked of it)."""

ROWS: tuple[Row, ...] = (
    ("steps", _steps, None, False),
    ("ranks · precision", lambda r: f"{r.ranks} · {r.precision}", None, False),
    (
        "attention · sharding",
        lambda r: f"{r.ran.get('attention', '-')} · {r.ran.get('sharding', '-')}",
        None,
        False,
    ),  # fmt: skip
    ("real tokens", lambda r: r.real_tokens, ",.0f", False),
    ("real tokens/s", lambda r: r.real_tokens_per_s, ",.0f", True),
    ("  over windows (min – max)", lambda r: _spread(r), None, False),
    ("real tokens per CPU-second", lambda r: r.real_tokens_per_cpu_s, ",.0f", True),
    ("train seconds (Σ steps)", lambda r: r.train_seconds, ".1f", True),
    ("  of them data (same work)", lambda r: r.data_seconds, ".1f", False),
    ("  of them vision tower (same work)", lambda r: r.vision_seconds, ".1f", False),
    ("  the rest (LM, optimizer)", lambda r: r.other_seconds, ".1f", True),
    ("run wall time s (+ eval, ckpt)", lambda r: r.wall_seconds, ".1f", True),
    ("padded tokens", lambda r: r.padded_tokens, ",.0f", False),
    ("padding fraction (executed)", lambda r: r.padding_fraction, ".3f", False),
    ("fill (real / rows × seq_length)", lambda r: r.fill, ".3f", False),
    ("conversations per row", lambda r: r.conversations_per_row, ".2f", False),
    ("final train loss", lambda r: r.final_train_loss, ".4f", False),
    (
        "eval loss (start → end)",
        lambda r: _start_end(r.eval_loss_start, r.eval_loss, ".4f"),
        None,
        False,
    ),
    (
        "eval token accuracy (start → end)",
        lambda r: _start_end(r.eval_token_accuracy_start, r.eval_token_accuracy, ".3f"),
        None,
        False,
    ),
    (
        "eval accuracy (start → end)",
        lambda r: _start_end(r.eval_accuracy_start, r.eval_accuracy, ".3f"),
        None,
        False,
    ),
    ("accuracy by chance", lambda r: r.eval_accuracy_chance, ".3f", False),
    ("useful FLOPs (exact)", lambda r: r.tflops_useful * 1e12, "FLOP", True),
    ("executed FLOPs (exact, padding incl.)", lambda r: r.tflops_executed * 1e12, "FLOP", True),
    ("useful FLOP/s", lambda r: r.tflops_per_s * 1e12, "FLOP/s", True),
)
"""The rows, in order (then per question kind after the accuracy, and the seconds to the
same eval loss)."""


def summary_table(
    runs: Sequence[RunSummary], *, title: str | None = None, source: str | None = None
) -> Table:
    """One or two runs' figures, one row per figure; ``source`` (where the figures came
    from: the MLflow store, a work dir) opens the caption. With a packed and an unpacked
    run, a ratio column and the pair's speedups, and seconds to the same eval loss; per
    question kind accuracy where every run has it; the MLflow run where known."""
    if len(runs) not in (1, 2):
        raise ValueError(f"a table of one or two runs, not {len(runs)}")
    pair = PackingComparison.of(runs) if len(runs) == 2 else None
    runs = pair.runs if pair else tuple(runs)
    default = (
        "packing on vs off · same conversations per optimizer step"
        if pair
        else f"train run {runs[0].run}"
    )
    notes = [source] if source else []
    if pair:
        notes.append(
            f"speedup (real tokens/s packed ÷ unpacked) {pair.speedup:.2f}x, window by window "
            f"{_median_range(pair.window_speedups())}; per CPU-second "
            f"{pair.speedup_per_cpu_s:.2f}x, window by window "
            f"{_median_range(pair.window_speedups(per_cpu_s=True))}"
        )
        notes.append(
            f"without the data "
            f"wait {pair.speedup_without_data:.2f}x; without data and vision "
            f"{pair.speedup_without_data_and_vision:.2f}x; executed FLOPs unpacked ÷ packed "
            f"{pair.flops_executed_ratio:.2f}x"
        )
    table = Table(
        title=title or default,
        title_justify="left",
        caption="\n".join(notes) or None,
        caption_justify="left",
    )
    table.add_column("figure")
    for r in runs:
        table.add_column(r.run, justify="right")
    if pair:
        table.add_column("packed ÷ unpacked", justify="right")

    def add(label: str, cells: list[str], ratio: str = "") -> None:
        table.add_row(label, *cells, *([ratio] if pair else []))

    if any(r.run_id for r in runs):
        add("MLflow run", [f"train-{r.run} {(r.run_id or '?')[:8]}" for r in runs])
    for label, value, fmt, with_ratio in ROWS:
        values = [value(r) for r in runs]
        if label.startswith("run wall time") and all(v is None for v in values):
            continue
        cells = [v if fmt is None else _num(v, fmt) for v in values]
        ratio = ""
        if pair and with_ratio:
            ratio = _ratio(*values)
            if label == "real tokens/s":
                ratio = f"[bold]{ratio}[/]"
        add(label, cells, ratio)
        if label.startswith("eval accuracy") and all(r.eval_by_kind for r in runs):
            for kind, k in runs[0].eval_by_kind.items():
                chance = "" if k.get("chance") is None else f", chance {k['chance']:.2f}"
                add(
                    f"  {kind} ({k['questions']} q{chance})",
                    [_num(r.eval_by_kind.get(kind, {}).get("accuracy"), ".3f") for r in runs],
                )
    if pair and pair.target_eval_loss is not None:
        reach = pair.seconds_to_eval_loss
        ratio = pair.seconds_to_eval_loss_ratio
        add(
            f"seconds to eval loss {pair.target_eval_loss:.4f}",
            [_num(reach[r.run], ".1f") for r in runs],
            "" if ratio is None else f"{1 / ratio:.2f}x",
        )
    return table


def target_lines(targets: Mapping[str, Target]) -> list[str]:
    """``bench train``'s targets (:meth:`PackingComparison.targets` and the bench's own), one
    rich-markup line each: value, rule, held or missed."""
    lines = []
    for name, t in targets.items():
        held = "[green]held[/]" if t.held else "[red]missed[/]"
        lines.append(f"{name}: {t.value:.4f} ({t.rule}) {held}")
    return lines
