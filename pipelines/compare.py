"""``packline compare``: packing on vs off, read back from the MLflow store.

Every figure comes from the metric histories the train stage logged (``MlflowClient``),
never from recomputing anything: the runs compared are the ``train-packed`` and
``train-unpacked`` child runs of the latest finished train stage of the experiment (or of
the pipeline / train-stage run passed as ``run_id``). Prints a side-by-side table, writes
three plots (loss vs real tokens, throughput per step, pack-fill histogram) and a JSON of
the figures to ``<work>/compare/``, and logs the plots to the pipeline's parent run.

Run layout in the store (what the stages write)::

    pipeline-<time>            tag packline.kind=pipeline
      └ train                  tag packline.stage=train (the stage run)
          ├ train-packed       tags packline.stage=train, packline.packing=true
          └ train-unpacked     tags packline.stage=train, packline.packing=false
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from packline.tracking import PARENT_TAG, experiment_name, tracking_uri
from schemas.config import PipelineConfig
from stages.base import InputError

#: artifact folder (on the parent run) and folder under the work dir
COMPARE_DIR = "compare"
PLOTS = (
    "loss_vs_real_tokens.png",
    "loss_vs_time.png",
    "throughput.png",
    "pack_fill_histogram.png",
)
#: the metrics the table and the plots read, per training run
HISTORY_KEYS = (
    "train/loss",
    "train/tokens_real",
    "train/cum_tokens_real",
    "train/padded_tokens",
    "train/conversations",
    "train/step_seconds",
    "train/flops_useful",
    "train/flops_executed",
    "throughput/real_tokens_per_s",
    "eval/loss",
    "eval/accuracy",
    "pack/rows",
    "pack/row_fill",
)


@dataclass
class TrainingPair:
    """The two training runs compared, and the runs above them."""

    experiment_id: str
    experiment_name: str
    packed: object  # mlflow.entities.Run
    unpacked: object
    stage_run_id: str
    pipeline_run: object | None  # the pipeline's parent run; None for `packline stage train`

    @property
    def log_run_id(self) -> str:
        """Where the plots are logged: the pipeline run, else the train stage run."""
        return self.pipeline_run.info.run_id if self.pipeline_run else self.stage_run_id


@dataclass(kw_only=True)
class RunFigures:
    """One training run's figures, each read from its MLflow metric histories."""

    run: str
    """``packed`` or ``unpacked``."""
    run_id: str
    steps: int
    """Optimizer steps in this run's history (a resumed run logs only the steps after the
    checkpoint it resumed from: ``first_step`` > 1)."""
    first_step: int
    last_step: int
    real_tokens: float
    """Σ ``train/tokens_real``."""
    train_seconds: float
    """Σ ``train/step_seconds``: time in optimizer steps (data, forward, backward, update)."""
    wall_seconds: float | None
    """The MLflow run's end − start: training plus evaluation and checkpoints."""
    real_tokens_per_s: float
    """Σ real tokens / Σ step seconds."""
    padding_fraction: float
    """Σ ``train/padded_tokens`` / (Σ real + Σ padded): executed tokens that are padding."""
    fill: float | None
    """Mean of ``pack/row_fill``: real tokens over rows × ``seq_length``."""
    conversations_per_pack: float | None
    """Σ ``train/conversations`` / Σ ``pack/rows`` (1 when packing is off)."""
    final_train_loss: float
    eval_loss_start: float | None
    eval_loss: float | None
    eval_accuracy_start: float | None
    eval_accuracy: float | None
    tflops_useful: float
    """Σ ``train/flops_useful`` / 1e12: exact FLOPs over the real tokens."""
    tflops_executed: float
    """Σ ``train/flops_executed`` / 1e12: exact FLOPs of the layout as run, padding included."""
    tflops_per_s: float
    """Useful TFLOPs / train seconds."""


@dataclass(kw_only=True)
class Comparison:
    experiment: str
    experiment_id: str
    tracking_uri: str
    pipeline_run_id: str | None
    pipeline_run_name: str | None
    stage_run_id: str
    packed: RunFigures
    unpacked: RunFigures
    speedup_real_tokens_per_s: float
    """packed real tokens/s ÷ unpacked real tokens/s."""
    plots: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


# -- reading the store -------------------------------------------------------------------------


def open_store(cfg: PipelineConfig, header: str = "nothing to compare"):
    """An ``MlflowClient`` on the config's store; ``InputError`` (under ``header``) when
    MLflow is off or the sqlite store does not exist yet (opening it would create one)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not cfg.mlflow.enabled:
        raise InputError(
            ["mlflow.enabled is false in this config: the stages logged nothing"], header
        )
    uri = tracking_uri(cfg)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise InputError(
            [f"no MLflow store at {db}: run `packline run` (same config) first"], header
        )
    return MlflowClient(tracking_uri=uri)


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` URI, else None."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


def _search(client, experiment_id: str, filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=filter_string,
            order_by=["attributes.start_time DESC"],
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def find_training_pair(client, experiment: str, run_id: str | None = None) -> TrainingPair:
    """The newest finished ``train-packed``/``train-unpacked`` pair of one train stage run.

    ``run_id`` narrows it to one pipeline run or one train stage run. A pipeline run whose
    train stage was skipped (up to date) has no training runs of its own: the newest pair
    is then the one that stage's record came from.
    """
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise InputError(
            [
                f"no MLflow experiment named {experiment!r} in this store "
                "(the experiment is mlflow.experiment, else the pipeline name)"
            ],
            "nothing to compare",
        )
    runs = _search(
        client,
        exp.experiment_id,
        "tags.`packline.stage` = 'train' and attributes.status = 'FINISHED'",
    )
    by_stage: dict[str, dict[str, object]] = {}
    for r in runs:  # newest first: keep the newest of each mode under each stage run
        mode = r.data.tags.get("packline.packing")
        parent = r.data.tags.get(PARENT_TAG)
        if mode is None or parent is None:
            continue  # the stage run itself
        by_stage.setdefault(parent, {}).setdefault(mode, r)
    pairs = [(stage, m) for stage, m in by_stage.items() if {"true", "false"} <= set(m)]
    stage_parents = {}
    for stage, _ in pairs:
        stage_run = client.get_run(stage)
        stage_parents[stage] = stage_run.data.tags.get(PARENT_TAG)
    if run_id:
        pairs = [(s, m) for s, m in pairs if run_id in (s, stage_parents[s])]
    if not pairs and run_id:
        raise InputError(
            [
                f"no finished train-packed and train-unpacked runs under run {run_id}: pass "
                f"a pipeline or train-stage run id of experiment {experiment!r}"
            ],
            "nothing to compare",
        )
    if not pairs:
        raise InputError(
            [
                f"no finished train-packed and train-unpacked runs in experiment "
                f"{experiment!r}: run `packline run` with train.compare_packing=true "
                "(the default) first"
            ],
            "nothing to compare",
        )
    stage, modes = max(pairs, key=lambda p: max(r.info.start_time for r in p[1].values()))
    pipeline_id = stage_parents[stage]
    pipeline = client.get_run(pipeline_id) if pipeline_id else None
    return TrainingPair(
        experiment_id=exp.experiment_id,
        experiment_name=experiment,
        packed=modes["true"],
        unpacked=modes["false"],
        stage_run_id=stage,
        pipeline_run=pipeline,
    )


def metric_histories(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """``HISTORY_KEYS`` of one run as (step, value) sorted by step; a step logged twice
    keeps its last value."""
    out = {}
    for key in HISTORY_KEYS:
        by_step: dict[int, tuple[int, float]] = {}
        for m in client.get_metric_history(run_id, key):
            if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                by_step[m.step] = (m.timestamp, m.value)
        out[key] = [(step, v) for step, (_, v) in sorted(by_step.items())]
    return out


def _values(h: dict, key: str) -> list[float]:
    return [v for _, v in h[key]]


def _at(h: dict, key: str, step: int) -> float | None:
    return next((v for s, v in h[key] if s == step), None)


def run_figures(run, h: dict[str, list[tuple[int, float]]]) -> RunFigures:
    """The table's figures of one run from its histories (``metric_histories``)."""
    name = "packed" if run.data.tags.get("packline.packing") == "true" else "unpacked"
    if not h["train/loss"]:
        raise InputError(
            [f"run {run.info.run_id} ({run.info.run_name}) has no train/loss history"],
            "nothing to compare",
        )
    steps = [s for s, _ in h["train/loss"]]
    real = sum(_values(h, "train/tokens_real"))
    padded = sum(_values(h, "train/padded_tokens"))
    seconds = sum(_values(h, "train/step_seconds"))
    rows = sum(_values(h, "pack/rows"))
    fills = _values(h, "pack/row_fill")
    evals = h["eval/loss"]
    accs = h["eval/accuracy"]
    end = run.info.end_time
    return RunFigures(
        run=name,
        run_id=run.info.run_id,
        steps=len(steps),
        first_step=steps[0],
        last_step=steps[-1],
        real_tokens=real,
        train_seconds=seconds,
        wall_seconds=(end - run.info.start_time) / 1000 if end else None,
        real_tokens_per_s=real / seconds if seconds else 0.0,
        padding_fraction=padded / (real + padded) if real + padded else 0.0,
        fill=sum(fills) / len(fills) if fills else None,
        conversations_per_pack=sum(_values(h, "train/conversations")) / rows if rows else None,
        final_train_loss=h["train/loss"][-1][1],
        eval_loss_start=_at(h, "eval/loss", 0),
        eval_loss=evals[-1][1] if evals else None,
        eval_accuracy_start=_at(h, "eval/accuracy", 0),
        eval_accuracy=accs[-1][1] if accs else None,
        tflops_useful=sum(_values(h, "train/flops_useful")) / 1e12,
        tflops_executed=sum(_values(h, "train/flops_executed")) / 1e12,
        tflops_per_s=sum(_values(h, "train/flops_useful")) / 1e12 / seconds if seconds else 0.0,
    )


# -- plots ----------------------------------------------------------------------------------

COLORS = {"packed": "#1f77b4", "unpacked": "#ff7f0e"}
LABELS = {"packed": "packing on", "unpacked": "packing off"}
#: packing off drawn thinner and dashed on top: the loss curves coincide by design (same
#: conversations per optimizer step), and both must stay visible
STYLE = {
    "packed": {"color": COLORS["packed"], "lw": 3.5, "marker": "o", "ms": 5},
    "unpacked": {"color": COLORS["unpacked"], "lw": 1.5, "ls": "--", "marker": "x", "ms": 5},
}


def write_plots(
    out: Path, hist: dict[str, dict], figures: dict[str, RunFigures], seq_length: str
) -> list[Path]:
    """The three PNGs (Agg backend) of the two runs' histories; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    cum_seconds = {}
    for run, h in hist.items():
        total, cum_seconds[run] = 0.0, {0: 0.0}
        for s, v in h["train/step_seconds"]:
            total += v
            cum_seconds[run][s] = total
    x_axes = {
        PLOTS[0]: (
            "real tokens trained (cumulative)",
            lambda run, h: dict(h["train/cum_tokens_real"]),
        ),
        PLOTS[1]: ("training seconds (cumulative step time)", lambda run, h: cum_seconds[run]),
    }
    for png, (xlabel, x_of) in x_axes.items():
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        for run, h in hist.items():
            x = {0: 0.0, **x_of(run, h)}
            steps = [s for s, _ in h["train/loss"] if s in x]
            ax.plot(
                [x[s] for s in steps],
                [_at(h, "train/loss", s) for s in steps],
                **STYLE[run],
                label=f"{LABELS[run]} · train loss",
            )
            ev = [(x[s], v) for s, v in h["eval/loss"] if s in x]
            if ev:
                ax.plot(
                    *zip(*ev, strict=True),
                    ls="none",
                    marker="D",
                    ms=8 if run == "packed" else 5,
                    mfc="none",
                    color=COLORS[run],
                    label=f"{LABELS[run]} · eval loss",
                )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (per token)")
        ax.set_title(f"Loss vs {xlabel.split(' (')[0]}: packing on and off")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out / png))

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for run, h in hist.items():
        pts = h["throughput/real_tokens_per_s"]
        ax.plot(
            [s for s, _ in pts],
            [v for _, v in pts],
            marker="o",
            ms=3,
            color=COLORS[run],
            label=f"{LABELS[run]} · per step",
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.axhline(
            figures[run].real_tokens_per_s,
            ls="--",
            color=COLORS[run],
            label=f"{LABELS[run]} · overall {figures[run].real_tokens_per_s:,.0f}",
        )
    speedup = figures["packed"].real_tokens_per_s / max(
        figures["unpacked"].real_tokens_per_s, 1e-12
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("real tokens / s")
    ax.set_title(f"Throughput: packing on is {speedup:.2f}x packing off")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / PLOTS[2]))

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    bins = [i / 20 for i in range(21)]
    for run, h in hist.items():
        fills = _values(h, "pack/row_fill")
        if fills:
            ax.hist(
                fills,
                bins=bins,
                alpha=0.6,
                color=COLORS[run],
                label=f"{LABELS[run]} · {len(fills)} rows, mean {sum(fills) / len(fills):.3f}",
            )
    if any(_values(h, "pack/row_fill") for h in hist.values()):
        ax.legend()
    else:  # runs of a train stage older than the pack/* metrics
        ax.text(0.5, 0.5, "pack/row_fill not logged by these runs", ha="center", va="center")
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"row fill (real tokens / seq_length {seq_length})")
    ax.set_ylabel("rows")
    ax.set_title("Pack fill per row (packing off: one conversation per row)")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / PLOTS[3]))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- the command ----------------------------------------------------------------------------


def compare_runs(
    cfg: PipelineConfig, *, experiment: str | None = None, run_id: str | None = None
) -> Comparison:
    """Read the newest packed/unpacked pair, print the table, write and log the plots."""
    from rich.console import Console

    from packline.tracking import Tracker

    client = open_store(cfg)
    name = experiment or experiment_name(cfg)
    pair = find_training_pair(client, name, run_id)
    hist = {
        "packed": metric_histories(client, pair.packed.info.run_id),
        "unpacked": metric_histories(client, pair.unpacked.info.run_id),
    }
    figures = {
        "packed": run_figures(pair.packed, hist["packed"]),
        "unpacked": run_figures(pair.unpacked, hist["unpacked"]),
    }
    off = figures["unpacked"].real_tokens_per_s
    out = cfg.work_path / COMPARE_DIR
    seq_length = pair.packed.data.params.get("packing.seq_length", "?")
    plots = write_plots(out, hist, figures, seq_length)
    pipeline = pair.pipeline_run
    result = Comparison(
        experiment=name,
        experiment_id=pair.experiment_id,
        tracking_uri=tracking_uri(cfg),
        pipeline_run_id=pipeline.info.run_id if pipeline else None,
        pipeline_run_name=pipeline.info.run_name if pipeline else None,
        stage_run_id=pair.stage_run_id,
        packed=figures["packed"],
        unpacked=figures["unpacked"],
        speedup_real_tokens_per_s=figures["packed"].real_tokens_per_s / off if off else 0.0,
        plots=[str(p) for p in plots],
    )
    summary = out / "compare.json"
    summary.write_text(json.dumps(result.to_dict(), indent=2))
    tracker = Tracker(client, pair.log_run_id)
    for path in [*plots, summary]:
        tracker.log_artifact(path, COMPARE_DIR)
    console = Console()  # stdout: the table is this command's output
    console.print(comparison_table(result))
    console.print(f"plots: {out}/{{{','.join(PLOTS)}}}")
    console.print(f"logged to MLflow run {pair.log_run_id} under artifacts/{COMPARE_DIR}/")
    return result


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    """The MLflow UI page comparing ``run_ids`` (hash route of the single-page app)."""
    runs = quote(json.dumps(run_ids, separators=(",", ":")))
    exps = quote(json.dumps([experiment_id], separators=(",", ":")))
    return f"{base.rstrip('/')}/#/compare-runs?runs={runs}&experiments={exps}"


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _start_end(start: float | None, end: float | None, fmt: str) -> str:
    if start is None:
        return _num(end, fmt)
    return f"{format(start, fmt)} → {_num(end, fmt)}"


def _ratio(on: float | None, off: float | None) -> str:
    if on is None or off is None or off == 0:
        return ""
    return f"{on / off:.2f}x"


def comparison_table(c: Comparison):
    """The rich table: one row per figure, packing on | off | on ÷ off."""
    from rich.table import Table

    on, off = c.packed, c.unpacked
    where = (
        f"pipeline run {c.pipeline_run_name} ({c.pipeline_run_id[:8]})"
        if c.pipeline_run_id
        else f"train stage run {c.stage_run_id[:8]}"
    )
    table = Table(
        title=f"packing on vs off · experiment {c.experiment} · {where}",
        title_justify="left",
        caption=(
            f"from {c.tracking_uri}; speedup = real tokens/s on ÷ off = "
            f"{c.speedup_real_tokens_per_s:.2f}x"
        ),
        caption_justify="left",
    )
    table.add_column("figure")
    table.add_column("packing on", justify="right")
    table.add_column("packing off", justify="right")
    table.add_column("on ÷ off", justify="right")

    def steps(f: RunFigures) -> str:
        resumed = f" (from {f.first_step})" if f.first_step > 1 else ""
        return f"{f.steps}{resumed}"

    rows = [
        ("MLflow run", f"train-packed {on.run_id[:8]}", f"train-unpacked {off.run_id[:8]}", ""),
        ("steps logged", steps(on), steps(off), ""),
        ("real tokens", f"{on.real_tokens:,.0f}", f"{off.real_tokens:,.0f}", ""),
        (
            "real tokens/s",
            f"{on.real_tokens_per_s:,.0f}",
            f"{off.real_tokens_per_s:,.0f}",
            f"[bold]{c.speedup_real_tokens_per_s:.2f}x[/]",
        ),
        (
            "train seconds (Σ steps)",
            f"{on.train_seconds:.1f}",
            f"{off.train_seconds:.1f}",
            _ratio(on.train_seconds, off.train_seconds),
        ),
        (
            "run wall time s (+ eval, ckpt)",
            _num(on.wall_seconds, ".1f"),
            _num(off.wall_seconds, ".1f"),
            _ratio(on.wall_seconds, off.wall_seconds),
        ),
        (
            "padding fraction (executed)",
            f"{on.padding_fraction:.3f}",
            f"{off.padding_fraction:.3f}",
            "",
        ),
        ("fill (real / rows × seq_length)", _num(on.fill, ".3f"), _num(off.fill, ".3f"), ""),
        (
            "conversations per row",
            _num(on.conversations_per_pack, ".2f"),
            _num(off.conversations_per_pack, ".2f"),
            "",
        ),
        ("final train loss", f"{on.final_train_loss:.4f}", f"{off.final_train_loss:.4f}", ""),
        (
            "eval loss (start → end)",
            _start_end(on.eval_loss_start, on.eval_loss, ".4f"),
            _start_end(off.eval_loss_start, off.eval_loss, ".4f"),
            "",
        ),
        (
            "eval accuracy (start → end)",
            _start_end(on.eval_accuracy_start, on.eval_accuracy, ".2f"),
            _start_end(off.eval_accuracy_start, off.eval_accuracy, ".2f"),
            "",
        ),
        (
            "useful TFLOPs (exact)",
            f"{on.tflops_useful:.4f}",
            f"{off.tflops_useful:.4f}",
            _ratio(on.tflops_useful, off.tflops_useful),
        ),
        (
            "executed TFLOPs (exact, padding incl.)",
            f"{on.tflops_executed:.4f}",
            f"{off.tflops_executed:.4f}",
            _ratio(on.tflops_executed, off.tflops_executed),
        ),
        (
            "useful TFLOP/s",
            f"{on.tflops_per_s:.4f}",
            f"{off.tflops_per_s:.4f}",
            _ratio(on.tflops_per_s, off.tflops_per_s),
        ),
    ]
    for row in rows:
        table.add_row(*row)
    return table
