"""Plots of training runs (matplotlib, Agg backend): loss over real tokens and over
training time, throughput per step and the pack-fill histogram of packing on against off;
the fill histogram of one run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from packline import metrics as M
from packline.report.mlflow_store import History
from packline.report.summary import PackingComparison

if TYPE_CHECKING:
    import pandas as pd

PLOTS = (
    "loss_vs_real_tokens.png",
    "loss_vs_time.png",
    "throughput.png",
    "pack_fill_histogram.png",
)
"""The files :func:`write_plots` writes, in order."""
COLORS = {"packed": "#1f77b4", "unpacked": "#ff7f0e"}
LABELS = {"packed": "packing on", "unpacked": "packing off"}
#: packing off drawn thinner and dashed on top: the loss curves coincide by design (same
#: conversations per optimizer step), and both must stay visible
STYLE = {
    "packed": {"color": COLORS["packed"], "lw": 3.5, "marker": "o", "ms": 5},
    "unpacked": {"color": COLORS["unpacked"], "lw": 1.5, "ls": "--", "marker": "x", "ms": 5},
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _values(h: History, key: str) -> list[float]:
    return [v for _, v in h[key]]


def _save(fig, path: Path) -> Path:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _loss_plot(path: Path, hist: Mapping[str, History], xlabel: str, x_of) -> Path:
    """Train loss (lines) and eval loss (diamonds) of both runs over the x of ``x_of``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for run, h in hist.items():
        x = {0: 0.0, **x_of(run, h)}
        loss = dict(h[M.TRAIN_LOSS])
        steps = [s for s in loss if s in x]
        ax.plot(
            [x[s] for s in steps],
            [loss[s] for s in steps],
            **STYLE[run],
            label=f"{LABELS[run]} · train loss",
        )
        ev = [(x[s], v) for s, v in h[M.EVAL_LOSS] if s in x]
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
    return _save(fig, path)


def write_plots(
    out: Path, hist: Mapping[str, History], pair: PackingComparison, seq_length: int | str
) -> list[Path]:
    """The :data:`PLOTS` of both runs' histories (``{"packed": ..., "unpacked": ...}``, as
    :func:`~packline.report.mlflow_store.read_training_run` returns them) in ``out``;
    returns their paths."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    out.mkdir(parents=True, exist_ok=True)
    cum_seconds = {}
    for run, h in hist.items():
        total, cum_seconds[run] = 0.0, {0: 0.0}
        for s, v in h[M.TRAIN_STEP_SECONDS]:
            total += v
            cum_seconds[run][s] = total
    cum_tokens = M.cumulative(M.TRAIN_TOKENS_REAL)
    paths = [
        _loss_plot(
            out / PLOTS[0],
            hist,
            "real tokens trained (cumulative)",
            lambda run, h: dict(h[cum_tokens]),
        ),
        _loss_plot(
            out / PLOTS[1],
            hist,
            "training seconds (cumulative step time)",
            lambda run, h: cum_seconds[run],
        ),
    ]

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    by_run = {r.run: r for r in pair.runs}
    for run, h in hist.items():
        pts = h[M.THROUGHPUT_REAL_TOKENS_PER_S]
        ax.plot(
            [s for s, _ in pts],
            [v for _, v in pts],
            marker="o",
            ms=3,
            color=COLORS[run],
            label=f"{LABELS[run]} · per step",
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        overall = by_run[run].real_tokens_per_s
        ax.axhline(
            overall, ls="--", color=COLORS[run], label=f"{LABELS[run]} · overall {overall:,.0f}"
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("real tokens / s")
    ax.set_title(f"Throughput: packing on is {pair.speedup:.2f}x packing off")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / PLOTS[2]))

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    bins = [i / 20 for i in range(21)]
    for run, h in hist.items():
        fills = _values(h, M.PACK_ROW_FILL)
        if fills:
            ax.hist(
                fills,
                bins=bins,
                alpha=0.6,
                color=COLORS[run],
                label=f"{LABELS[run]} · {len(fills)} rows, mean {sum(fills) / len(fills):.3f}",
            )
    if any(_values(h, M.PACK_ROW_FILL) for h in hist.values()):
        ax.legend()
    else:
        ax.text(0.5, 0.5, f"{M.PACK_ROW_FILL} not logged by these runs", ha="center", va="center")
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"row fill (real tokens / seq_length {seq_length})")
    ax.set_ylabel("rows")
    ax.set_title("Pack fill per row (packing off: one conversation per row)")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / PLOTS[3]))
    return paths


def plot_row_fill(row_real_tokens: Sequence[int], seq_length: int, path: Path, name: str) -> Path:
    """Histogram of real tokens / ``seq_length`` over the rows one run laid out (packed
    rows, or one per conversation when packing is off), saved to ``path``."""
    plt = _pyplot()
    fills = [n / seq_length for n in row_real_tokens]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(fills, bins=20, range=(0, 1), color="#4c72b0")
    mean = sum(fills) / len(fills) if fills else 0.0
    ax.set_title(f"{name}: fill of {len(fills)} rows (mean {mean:.3f})")
    ax.set_xlabel("real tokens / seq_length")
    ax.set_ylabel("rows")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_length_histogram(df: pd.DataFrame, seq_length: int, path: Path) -> None:
    """connect's ``length_histogram.png``: text and total tokens per conversation against
    ``seq_length``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    bins = 50
    ax.hist(
        [df["text_tokens"], df["total_tokens"]],
        bins=bins,
        label=["text tokens", "total tokens (text + image)"],
        alpha=0.75,
    )
    ax.axvline(seq_length, color="crimson", linestyle="--", label=f"seq_length {seq_length}")
    ax.set_xlabel("tokens per conversation")
    ax.set_ylabel("conversations")
    ax.set_title(f"Conversation lengths ({len(df):,} samples)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_cluster_packing(
    cluster: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path
) -> Path:
    """``bench packing``'s cluster comparison: fill against buffer size per packer (Bridge's
    FFD, packline's refined selection without and with carry-over) and the buffer bound, one
    panel per distribution; saved to ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(cluster), figsize=(5.5 * len(cluster), 3.8), squeeze=False)
    for ax, (dist, methods) in zip(axes[0], cluster.items(), strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        bound: dict[int, float] = {}
        for name, figures in methods.items():
            packer, _, buffer = name.rpartition("@")
            series.setdefault(packer, []).append((int(buffer), figures["fill"]))
            bound[int(buffer)] = figures["buffer_bound_fill"]
        for packer, points in series.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=packer)
        xs = sorted(bound)
        ax.plot(xs, [bound[x] for x in xs], ls=":", color="grey", label="buffer bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("packing buffer (samples per loader worker)")
        ax.set_ylabel("fill (real tokens / row capacity)")
        ax.set_title(dist)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)
