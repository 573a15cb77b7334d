"""The forecast table: what packing will do to this data, from connect's ``forecast.json``
(:func:`packline.forecast.config_forecast`), before a step is trained. ``packline run``
prints it once, after connect."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table

from packline.progress import si


def forecast_table(forecast: dict[str, Any], buffer: int) -> Group:
    """One row per packing buffer size (rows, fill, and without carry-over where it is on),
    the configured ``buffer`` marked in the fill the run packs with (with carry-over when it
    is on); the lines under it give packing off, the bound, and
    the epoch's exact FLOPs packed vs unpacked (lines of the console's width, not the
    table's)."""
    carry = bool(forecast.get("max_carry_rounds"))
    title = (
        f"[bold]packing forecast[/] · {forecast['samples']:,} samples, "
        f"{forecast['tokens']:,} tokens, rows of {forecast['capacity']:,} tokens"
    )
    table = Table()
    table.add_column("buffer", justify="right")
    table.add_column("rows", justify="right")
    table.add_column("fill", justify="right")
    if carry:
        table.add_column("fill without carry-over", justify="right")
    for b, v in forecast["buffers"].items():
        mark = " ← packing_buffer_size" if int(b) == buffer else ""
        cells = [f"{int(b):,}", f"{v['packs']:,}", f"{v['fill']:.3f}{mark}"]
        if carry:
            cells.append(f"{v.get('fill_without_carry', v['fill']):.3f}")
        table.add_row(*cells)
    off, bound, flops = forecast["unpacked"], forecast["lower_bound"], forecast.get("flops", {})
    notes = [
        f"packing off: {off['rows']:,} rows, fill {off['fill']:.3f}; no packer can do better "
        f"than {bound['packs']:,} rows (all tokens ÷ row length), fill {bound['fill']:.3f}",
    ]
    if flops:
        notes.append(
            f"one epoch executes {si(flops['epoch_executed_packed'], 'FLOP')} packed vs "
            f"{si(flops['epoch_executed_unpacked'], 'FLOP')} unpacked (padding "
            f"{flops['padding_share_packed']:.1%} vs {flops['padding_share_unpacked']:.1%})"
        )
        if flops.get("straggler_ranks", 1) > 1:
            notes.append(
                f"straggler ratio {flops['straggler_ratio']:.3f} over "
                f"{int(flops['straggler_ranks'])} data-parallel ranks"
            )
    return Group(title, table, *notes)
