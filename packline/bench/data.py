"""``bench data``'s figures: samples/s of prepare and connect per worker count, peak RSS of
each stage's process tree at two dataset sizes, what 10⁶ samples would take per core, and
what one conversation at ``prepare.max_text_chars`` adds to connect's peak RSS.

A :class:`StageRun` is one stage run in its own process (``packline stage ...``), measured
from outside: its process tree's RSS polled (:class:`~packline.bench.processes.WorkerRss`)
and the stage's own seconds from its completion record (interpreter start-up and imports
left out, the same way for every run). :func:`data_figures` turns the runs into the
figures and :func:`data_targets` into the targets.

    >>> runs = [
    ...     StageRun("prepare", 20_000, 1, 40.0, 900.0),
    ...     StageRun("prepare", 20_000, 2, 25.0, 1_500.0),
    ...     StageRun("prepare", 5_000, 2, 7.0, 1_480.0),
    ... ]
    >>> f = data_figures(runs, large=20_000, small=5_000)
    >>> f["prepare"]["samples_per_s"], f["prepare"]["speedup_2_vs_1"]
    ({'1': 500.0, '2': 800.0}, 1.6)
    >>> f["prepare"]["projected_hours_1e6_per_core"], f["prepare"]["rss_growth"]
    (0.5556, 0.0135)
    >>> data_targets(f)["prepare.rss_growth"]["held"]
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: The peak RSS at the large size may exceed the small size's by at most this share.
RSS_GROWTH_TARGET = 0.10
#: Another source of the same rows (Parquet, media embedded) prepares at least this fast
#: relative to the folder.
VS_FOLDER_TARGET = 1.0
#: The dataset size the projection is for.
PROJECTED_SAMPLES = 1_000_000
#: One conversation at ``prepare.max_text_chars`` (longer ones prepare rejects) may add at
#: most this much to connect's peak RSS: the bound on what one row costs (without it a 50 MB
#: turn cost connect 10.8 GB).
LONG_ROW_TARGET_MIB = 512


@dataclass
class StageRun:
    """One measured stage run."""

    stage: str
    #: samples the stage handled (prepare: rows read; connect: samples measured)
    samples: int
    #: prepare.num_workers or connect.num_workers
    workers: int
    #: the stage's own seconds (its completion record)
    seconds: float
    #: peak RSS of the stage's whole process tree (workers included), MiB
    peak_rss_mib: float
    #: "" for the size and worker runs; "long_row": the small set plus one conversation at
    #: prepare.max_text_chars; "parquet": the same rows as a Parquet file, media embedded
    variant: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": self.samples_per_s}


def data_figures(runs: list[StageRun], *, large: int, small: int) -> dict[str, Any]:
    """Per stage: samples/s at the large size per worker count, the 2-vs-1 speedup, the
    hours 10⁶ samples take on one core (at the 1-worker rate), and the peak RSS of the same
    worker count at both sizes with its relative growth."""
    out: dict[str, Any] = {}
    long_rows = {r.stage: r for r in runs if r.variant == "long_row"}
    runs = [r for r in runs if r.variant != "long_row"]
    for stage in dict.fromkeys(_source_stage(r) for r in runs):
        mine = [r for r in runs if _source_stage(r) == stage]
        at_large = {r.workers: r for r in mine if r.samples == large}
        at_small = {r.workers: r for r in mine if r.samples == small}
        rates = {str(w): round(r.samples_per_s, 1) for w, r in sorted(at_large.items())}
        figures: dict[str, Any] = {"samples_per_s": rates}
        if 1 in at_large and 2 in at_large:
            figures["speedup_2_vs_1"] = round(
                at_large[2].samples_per_s / at_large[1].samples_per_s, 3
            )
        if 1 in at_large:
            hours = PROJECTED_SAMPLES / at_large[1].samples_per_s / 3600
            figures["projected_hours_1e6_per_core"] = round(hours, 4)
            figures["ms_per_sample_per_core"] = round(1000 / at_large[1].samples_per_s, 3)
        both = sorted(set(at_large) & set(at_small))
        if both:
            w = both[-1]
            big, little = at_large[w].peak_rss_mib, at_small[w].peak_rss_mib
            figures["rss_mib"] = {str(small): round(little, 1), str(large): round(big, 1)}
            figures["rss_workers"] = w
            figures["rss_growth"] = round((big - little) / little, 4)
        if stage in long_rows and small + 1 == long_rows[stage].samples and 2 in at_small:
            base, with_long = at_small[2].peak_rss_mib, long_rows[stage].peak_rss_mib
            figures["long_row_rss_mib"] = {
                "without": round(base, 1),
                "with": round(with_long, 1),
                "added": round(with_long - base, 1),
            }
        out[stage] = figures
    for stage, f in out.items():  # a source beside the folder, same rows, same workers
        base, _, variant = stage.partition(".")
        if variant and base in out:
            mine, folder = f["samples_per_s"], out[base]["samples_per_s"]
            if shared := sorted(set(mine) & set(folder), key=int):
                w = shared[-1]
                f["vs_folder"] = round(mine[w] / folder[w], 3)
                f["vs_folder_workers"] = int(w)
    return out


def _source_stage(run: StageRun) -> str:
    """The figures' key of a run: its stage, ``.<variant>`` for another source's runs."""
    return f"{run.stage}.{run.variant}" if run.variant else run.stage


def data_targets(figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets: each stage's peak RSS grows by less than :data:`RSS_GROWTH_TARGET`
    from the small to the large set (bounded memory: no list of all rows), and one
    conversation at the text bound adds less than :data:`LONG_ROW_TARGET_MIB` to connect's."""
    targets = {
        f"{stage}.rss_growth": {
            "held": abs(f["rss_growth"]) < RSS_GROWTH_TARGET,
            "value": f["rss_growth"],
            "rule": f"|growth| < {RSS_GROWTH_TARGET:.0%} from {min(f['rss_mib'], key=int)} "
            f"to {max(f['rss_mib'], key=int)} samples",
        }
        for stage, f in figures.items()
        if "rss_growth" in f
    }
    for stage, f in figures.items():
        if "vs_folder" in f:
            targets[f"{stage}.vs_folder"] = {
                "held": f["vs_folder"] >= VS_FOLDER_TARGET,
                "value": f["vs_folder"],
                "rule": f"samples/s ≥ {VS_FOLDER_TARGET:g}x the folder's, same rows, "
                f"{f['vs_folder_workers']} workers",
            }
    if "long_row_rss_mib" in figures.get("connect", {}):
        added = figures["connect"]["long_row_rss_mib"]["added"]
        targets["connect.long_row_rss"] = {
            "held": added < LONG_ROW_TARGET_MIB,
            "value": added,
            "rule": f"one conversation at prepare.max_text_chars adds < {LONG_ROW_TARGET_MIB} "
            "MiB to connect's peak RSS",
        }
    return targets
