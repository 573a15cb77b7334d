"""``packline bench data``: prepare and connect on a set of 20,000 conversations (the
built-in set at that size), with 1 and 2 workers side by side in one run, their peak RSS at
two dataset sizes, the projected time of 10⁶ samples per core, connect's peak RSS with
one more conversation, of ``prepare.max_text_chars`` characters, beside the small set's, and
prepare on the same rows as a Parquet file with the media embedded (a Hugging Face dataset's
form) beside the folder, at both sizes.

Each stage runs as its own process (``packline stage NAME --force``, as a user or a SLURM
task runs it) on the same rows: the large set's folder once generated, a small set made of
its first rows (the same media, hard-linked), and the small set plus the long row. The
figures and targets are :mod:`packline.bench.data`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from packline.bench.data import StageRun, data_figures, data_targets
from packline.bench.processes import WorkerRss
from packline.bench.tables import print_targets
from packline.progress import console, stdout_to_stderr, wide_console
from schemas.config import load_config

#: The samples each stage's count is read from (its completion record's metrics).
SAMPLE_METRIC = {"prepare": "prepare/rows_total", "connect": "connect/samples"}


def _source(work_dir: Path, config: str | Path | None, overrides: list[str], samples: int) -> Path:
    """The built-in set with ``samples`` conversations (5% of them val), generated once."""
    from packline.sources import resolve_source

    num_val = max(samples // 20, 1)
    cfg = load_config(
        config,
        [
            *overrides,
            f"work_dir={work_dir / 'generated'}",
            f"data.num_train={samples - num_val}",
            f"data.num_val={num_val}",
        ],
    )
    return resolve_source(cfg)


def _first_rows(source: Path, dest: Path, samples: int) -> Path:
    """A folder of ``source``'s first ``samples`` rows, its media hard-linked (no copy)."""
    if (dest / "conversations.jsonl").is_file():
        return dest
    for path in source.rglob("*"):
        if path.is_file() and path.name != "conversations.jsonl":
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.link(path, target)
    with (source / "conversations.jsonl").open() as f:
        rows = [line for _, line in zip(range(samples), f, strict=False)]
    (dest / "conversations.jsonl").write_text("".join(rows))
    return dest


def _as_parquet(folder: Path, dest: Path, rows_per_group: int = 100) -> Path:
    """``folder``'s rows as one Parquet file of ``dest`` (``conversations`` layout), each
    image's and video's bytes embedded as Hugging Face's ``Image`` / ``Video`` structs in
    row groups of ``rows_per_group`` (``datasets``' default for media), written a group at a
    time: what prepare reads from a Hugging Face dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = dest / "data" / "train-00000-of-00001.parquet"
    if path.is_file():
        return dest
    media = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    turn = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [("id", pa.string()), ("conversations", pa.list_(turn)), ("images", media),
         ("videos", media), ("split", pa.string())]
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")

    def embedded(names: list[str]) -> list[dict[str, Any]]:
        return [{"bytes": (folder / n).read_bytes(), "path": Path(n).name} for n in names]

    with pq.ParquetWriter(tmp, schema) as writer, (folder / "conversations.jsonl").open() as f:
        group: list[dict[str, Any]] = []
        for line in f:
            row = json.loads(line)
            group.append(
                {
                    "id": str(row["id"]),
                    "conversations": row["conversations"],
                    "images": embedded(row.get("images", [])),
                    "videos": embedded(row.get("videos", [])),
                    "split": row.get("split"),
                }
            )
            if len(group) == rows_per_group:
                writer.write_table(pa.Table.from_pylist(group, schema=schema))
                group = []
        if group:
            writer.write_table(pa.Table.from_pylist(group, schema=schema))
    tmp.rename(path)
    return dest


def _with_long_row(source: Path, dest: Path, chars: int) -> Path:
    """``source``'s folder (media hard-linked) plus one text-only conversation of exactly
    ``chars`` characters of text, the most prepare lets through; words of varied length, so
    the tokenizer makes of it what it makes of prose."""
    import random

    _first_rows(source, dest, samples=10**12)
    rng = random.Random(0)
    words = ["the", "shape", "colour", "left", "of", "a", "red", "circle", "triangle", "is"]
    answer = "Yes."
    budget = chars - len("user") - len("assistant") - len(answer)
    text = ""
    while len(text) < budget:
        text += rng.choice(words) + " "
    row = {
        "id": "long-row",
        "conversations": [
            {"role": "user", "content": text[:budget]},
            {"role": "assistant", "content": answer},
        ],
    }
    with (dest / "conversations.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return dest


def _run_stage(
    stage: str,
    work: Path,
    config: str | Path | None,
    overrides: list[str],
    workers: int,
    variant: str = "",
) -> StageRun:
    """``packline stage STAGE --force`` in its own process, its process tree's RSS watched."""
    args = [sys.executable, "-m", "pipelines.cli", "stage", stage, "--force"]
    args += [str(config)] if config else []
    args += [
        *overrides,
        f"work_dir={work}",
        "mlflow.enabled=false",
        f"{stage}.num_workers={workers}",
    ]
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"bench-{stage}.log"
    with WorkerRss(interval_s=0.05) as rss, log.open("w") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"bench data: {stage} failed (exit {done.returncode}):\n{tail}")
    record = json.loads((work / stage / "_COMPLETE.json").read_text())
    samples = int(record["metrics"][SAMPLE_METRIC[stage]])
    return StageRun(stage, samples, workers, float(record["seconds"]), rss.peak_mb, variant)


def bench_data(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    num_samples: int = 20_000,
    small_samples: int | None = None,
) -> dict[str, Any]:
    """Measure and print (``as_json``: one JSON object); returns the result. The small set
    is the large one's first ``small_samples`` rows (default: a quarter)."""
    small_samples = small_samples or num_samples // 4
    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / "bench"
    root = work_dir / "data"
    overrides = list(overrides or [])
    runs: list[StageRun] = []
    with stdout_to_stderr(as_json):
        console.log(f"bench data: the built-in set at {num_samples:,} conversations, {root}")
        large = _source(root, config, overrides, num_samples)
        small = _first_rows(large, root / f"first{small_samples}", small_samples)
        max_chars = load_config(config, overrides).prepare.max_text_chars
        long_row = _with_long_row(small, root / f"first{small_samples}-long", max_chars)
        console.log("bench data: the same rows as Parquet, images and videos embedded")
        large_pq = _as_parquet(large, root / "parquet")
        small_pq = _as_parquet(small, root / f"first{small_samples}-parquet")
        plan = [
            (large, 1, "large-w1", ""),
            (large, 2, "large-w2", ""),
            (small, 2, "small-w2", ""),
            (long_row, 2, "small-long-w2", "long_row"),
            (large_pq, 2, "parquet-large-w2", "parquet"),
            (small_pq, 2, "parquet-small-w2", "parquet"),
        ]
        for stage in ("prepare", "connect"):
            for source, workers, name, variant in plan:
                if stage == "connect" and variant == "parquet":
                    continue  # connect reads the same shards
                args = [*overrides, f"data.source={source}"]
                run = _run_stage(stage, root / name, config, args, workers, variant)
                console.log(
                    f"bench data: {stage} {run.samples:,} samples, {workers} worker(s): "
                    f"{run.samples_per_s:.1f}/s, peak RSS {run.peak_rss_mib:,.0f} MiB"
                )
                runs.append(run)
        sizes = {r.samples for r in runs if r.stage == "prepare"}
        figures = data_figures(runs, large=max(sizes), small=min(sizes))
    result = {
        "cpu_count": os.cpu_count(),
        "runs": [r.to_dict() for r in runs],
        "figures": figures,
        "targets": data_targets(figures),
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_data_tables(wide_console(), result)
    return result


def print_data_tables(out: Console, result: dict[str, Any]) -> None:
    """The runs, the figures side by side, and the targets."""
    table = Table(title=f"bench data: each stage in its own process ({result['cpu_count']} CPUs)")
    for col in ("stage", "samples", "workers", "seconds", "samples/s", "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in result["runs"]:
        table.add_row(
            r["stage"] + {"long_row": " + long row", "parquet": " (Parquet)"}.get(r["variant"], ""),
            f"{r['samples']:,}",
            str(r["workers"]),
            f"{r['seconds']:.1f}",
            f"{r['samples_per_s']:.1f}",
            f"{r['peak_rss_mib']:,.0f}",
        )
    out.print(table)
    table = Table(title="side by side")
    columns = ("stage", "2 vs 1 workers", "vs folder", "ms/sample/core", "10⁶ samples/core")
    for col in (*columns, "RSS growth"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage, f in result["figures"].items():
        rss = f.get("rss_mib", {})
        table.add_row(
            stage,
            f"{f['speedup_2_vs_1']:.2f}x" if "speedup_2_vs_1" in f else "-",
            f"{f['vs_folder']:.2f}x" if "vs_folder" in f else "-",
            f"{f['ms_per_sample_per_core']:.2f}" if "ms_per_sample_per_core" in f else "-",
            f"{f['projected_hours_1e6_per_core']:.2f} h"
            if "projected_hours_1e6_per_core" in f
            else "-",
            " → ".join(f"{v:,.0f}" for v in rss.values()) + f" MiB ({f['rss_growth']:+.1%})"
            if rss
            else "-",
        )
    out.print(table)
    long_row = result["figures"].get("connect", {}).get("long_row_rss_mib")
    if long_row:
        out.print(
            f"connect with one conversation at prepare.max_text_chars: peak RSS "
            f"{long_row['without']:,.0f} → {long_row['with']:,.0f} MiB "
            f"({long_row['added']:+,.0f} MiB)"
        )
    print_targets(out, result["targets"])
