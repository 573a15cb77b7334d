"""``packline bench packing``: selection algorithms measured side by side in one run.

For a seeded long-tailed length distribution (log-normal, like conversations with images),
packs the same stream with FFD and BFD at several buffer sizes and reports fill and
selection time per sample, plus each algorithm's time relative to FFD.
"""

from __future__ import annotations

import json
import random
import time

from packline.packing.selection import best_fit_decreasing, first_fit_decreasing, pack_fill

BUFFERS = (1, 16, 64, 256, 1024)


def _lengths(n: int, capacity: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(capacity, max(16, int(rng.lognormvariate(5.6, 0.8)))) for _ in range(n)]


def bench_packing(*, n: int = 20000, capacity: int = 2048, seed: int = 0, as_json: bool = False):
    lengths = _lengths(n, capacity, seed)
    rows = []
    for b in BUFFERS:
        row = {"buffer": b}
        for name, fn in (("ffd", first_fit_decreasing), ("bfd", best_fit_decreasing)):
            t0 = time.perf_counter()
            packs = filled = 0
            for start in range(0, n, b):
                chunk = lengths[start : start + b]
                groups = fn(chunk, capacity)
                packs += len(groups)
                filled += pack_fill(chunk, groups, capacity) * len(groups) * capacity
            dt = time.perf_counter() - t0
            row[f"{name}_fill"] = filled / (packs * capacity)
            row[f"{name}_us_per_sample"] = 1e6 * dt / n
        row["bfd_time_vs_ffd"] = row["bfd_us_per_sample"] / row["ffd_us_per_sample"]
        rows.append(row)
    if as_json:
        print(json.dumps({"samples": n, "capacity": capacity, "rows": rows}, indent=2))
        return rows
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"packing selection: {n:,} samples, capacity {capacity}")
    for col in ("buffer", "ffd fill", "bfd fill", "ffd µs/sample", "bfd µs/sample", "bfd/ffd time"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["buffer"]),
            f"{r['ffd_fill']:.4f}",
            f"{r['bfd_fill']:.4f}",
            f"{r['ffd_us_per_sample']:.2f}",
            f"{r['bfd_us_per_sample']:.2f}",
            f"{r['bfd_time_vs_ffd']:.2f}x",
        )
    Console().print(table)
    return rows
