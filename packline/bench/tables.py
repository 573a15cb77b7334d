"""The benchmark's figures as rich tables: the fills, the loader's worker RSS and
throughput, the selection time and the targets. Each function prints to the console it is
handed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from packline.bench import CLUSTER_SEQ_LENGTH, SEQ_LENGTH
from packline.bench.targets import Target

if TYPE_CHECKING:  # the loader module imports torch and Energon; the tables need neither
    from packline.bench.loader import LoaderRun


def print_cluster_tables(out: Console, cluster: dict[str, dict[str, dict[str, float]]]) -> None:
    """Bridge's packer against packline's in Bridge, per distribution."""
    for dist, label in (("default", "default set"), ("vlm_sft", "synthetic VLM SFT")):
        table = Table(
            title=f"cluster packing at seq_length {CLUSTER_SEQ_LENGTH}: {label}",
            caption=(
                "bridge_ffd: Bridge's own encoder (plain FFD, no carry-over); packline_refined: "
                "packline's packer in Bridge, carry-over off; packline_carry: on (4 rounds); "
                "_balanced: with packing.balance=flops. "
                "round bound: the best fill of any packer emitting every round whole; buffer "
                "bound: of any packer at all (a row holds at most a buffer of samples); "
                "straggler: the slowest of 8 data-parallel ranks' step FLOPs over their mean "
                "(Qwen3-VL-8B, 2 loader workers and 4 packs per rank per step); ∝ tokens: "
                "the same packs were FLOPs proportional to tokens (what balance cannot beat "
                "without emptier rows)"
            ),
        )
        cols = ("packer@buffer", "fill", "padding tokens", "rows", "round bound", "buffer bound")
        for col in (*cols, "straggler DP8", "∝ tokens", "ms/sample"):
            table.add_column(col, justify="right" if col != "packer@buffer" else "left")
        for name, f in cluster[dist].items():
            table.add_row(
                name,
                f"{f['fill']:.4f}",
                f"{f['padding_tokens']:,}",
                f"{f['rows']:,}",
                f"{f['round_bound_fill']:.4f}" if "carry" not in name else "-",
                f"{f['buffer_bound_fill']:.4f}",
                f"{f['straggler_ratio']:.4f}" if "straggler_ratio" in f else "-",
                f"{f['straggler_ratio_tokens']:.4f}" if "straggler_ratio_tokens" in f else "-",
                f"{f['select_ms_per_sample']:.3f}",
            )
        out.print(table)


def print_packing_tables(
    out: Console,
    result: dict[str, Any],
    loader_runs: dict[str, LoaderRun],
    throughput: dict[str, list[LoaderRun]],
    select_s: dict[str, float],
    num_select_lengths: int,
) -> None:
    """Everything ``bench packing`` measured: the fill per method on each distribution,
    the loader tables, the selection time per algorithm and the targets."""
    for dist, label in (("default", "default set"), ("vlm_sft", "synthetic VLM SFT")):
        r = result[dist]
        fill = r["fill"]
        table = Table(
            title=(
                f"fill at seq_length {SEQ_LENGTH}: {label} — {r['samples']:,} samples, "
                f"{r['overlength']:,} overlength (dropped)"
            ),
            caption=(
                "eager and lazy encoders select identically: their simulated fills are equal "
                "by construction"
                + (
                    "; .measured = the real Energon loader, one epoch (its own stream order)"
                    if dist == "default"
                    else ""
                )
            ),
        )
        for col in ("method", "fill", "vs offline_bfd"):
            table.add_column(col, justify="right" if col != "method" else "left")
        for name, value in fill.items():
            table.add_row(name, f"{value:.4f}", f"{value / fill['offline_bfd']:.4f}")
        out.print(table)

    print_cluster_tables(out, result["cluster"])
    print_loader_tables(out, result, loader_runs, throughput)
    table = Table(title="selection time")
    for col in ("what", "value"):
        table.add_column(col, justify="right" if col != "what" else "left")
    for algorithm, s in select_s.items():
        table.add_row(f"select_packs {algorithm}, {num_select_lengths:,} lengths", f"{s:.3f} s")
    out.print(table)
    print_targets(out, result["targets"])


def print_loader_report(
    out: Console,
    result: dict[str, Any],
    loader_runs: dict[str, LoaderRun],
    throughput: dict[str, list[LoaderRun]],
) -> None:
    """Everything ``bench loader`` measured: the loader tables, the measured fill and the
    targets."""
    print_loader_tables(out, result, loader_runs, throughput)
    out.print(f"fill of lazy_ffd@256 through the loader: {result['fill_measured']:.4f}")
    print_targets(out, result["targets"])


def print_loader_tables(
    out: Console,
    result: dict[str, Any],
    loader_runs: dict[str, LoaderRun],
    throughput: dict[str, list[LoaderRun]],
) -> None:
    """The worker RSS per packed run, and the throughput without and with packing."""
    table = Table(
        title="loader worker on the default set (num_workers=1, one epoch), RSS in MiB",
        caption="growth = peak - RSS at the first pack, when the buffer is already full",
    )
    for col in ("encoder", "packs", "at fork", "1st pack", "peak", "growth", "s"):
        table.add_column(col, justify="right" if col != "encoder" else "left")
    for name, run in loader_runs.items():
        table.add_row(
            name,
            str(run.num_items),
            f"{run.start_rss_mb:.0f}" if run.start_rss_mb is not None else "-",
            f"{run.first_rss_mb:.0f}",
            f"{result['worker_rss_mb'][name]:.0f}",
            f"{result['worker_rss_growth_mb'][name]:.0f}",
            f"{run.seconds:.1f}",
        )
    out.print(table)

    table = Table(title="throughput (lazy encoder, num_workers=0, 1 torch thread)")
    for col in ("what", "value"):
        table.add_column(col, justify="right" if col != "what" else "left")
    for name, runs in throughput.items():
        rates = ", ".join(f"{run.num_samples / run.seconds:.1f}" for run in runs)
        table.add_row(
            f"samples/s {name}",
            f"{result['samples_per_s'][name]:.1f} (best of {rates}; {runs[0].num_samples} each)",
        )
    table.add_row("packing overhead", f"{result['packing_overhead']:+.1%}")
    out.print(table)


def print_targets(out: Console, targets: dict[str, Target]) -> None:
    """One row per target: its value (fills also against offline BFD and the round bound),
    its rule and whether it held."""
    table = Table(title="ratios and targets")
    table.add_column("target", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("rule")
    table.add_column("held")
    for name, t in targets.items():
        value = f"{t['value']:.4f}"
        if "vs_offline_bfd" in t:
            value += (
                f" ({t['vs_offline_bfd']:.4f}x offline, {t['vs_round_bound']:.4f}x round bound)"
            )
        table.add_row(name, value, t["rule"], "[green]yes[/]" if t["held"] else "[red]no[/]")
    out.print(table)


def print_cluster_memory(out: Console, result: dict[str, Any], rounds: int) -> None:
    """``bench cluster-memory``: the mean per packer and buffer, and the target."""
    table = Table(title=f"loader worker peak RSS, one epoch, mean of {rounds} runs each")
    for col in ("packer@buffer", "peak MiB", "start MiB", "rows", "samples"):
        table.add_column(col, justify="right" if col != "packer@buffer" else "left")
    for name, m in result["mean"].items():
        table.add_row(
            name,
            f"{m['peak_mb']:.0f}",
            f"{m['start_mb']:.0f}",
            f"{m['rows']:.0f}",
            f"{m['samples']:.0f}",
        )
    out.print(table)
    print_targets(out, result["targets"])
