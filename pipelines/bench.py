"""``packline bench packing``: packing fill, loader-worker memory and throughput, measured
side by side in one run at ``seq_length`` 2048 (:data:`packline.bench.SEQ_LENGTH`).

- **Fill** (real tokens / emitted capacity) on two length distributions: the default
  built-in set (train lengths from connect's ``lengths.parquet``) and a seeded synthetic
  one shaped like VLM SFT data (:func:`packline.bench.lengths.vlm_sft_lengths`), per
  method of :mod:`packline.bench.simulation` (no packing, eager and lazy packers per
  algorithm and buffer, offline BFD, the per-round bound, the lower bound).
  ``lazy_ffd@256.measured`` is the plain-FFD fill through the real Energon loader for one
  epoch (its stream order differs).
- **Worker RSS**: the real packed loader with one worker on the default set, the worker's
  RSS polled every 50 ms; peak, and growth over its RSS right after the first pack.
- **Throughput**: conversations/s through the loader with the lazy encoder, without
  packing and with ``lazy_ffd@256``, in the main process with one torch thread (as in a
  loader worker), over the same conversations (one epoch by default).
- **Selection time**: ``select_packs`` on 100,000 VLM-SFT lengths in one buffer, per
  algorithm (``refined`` refines rounds of at most ``REFINE_MAX_ITEMS`` items, so here it
  adds only the lower-bound check to ``ffd``).

Ratios and targets (:mod:`packline.bench.targets`) come with the tables; ``--json`` prints
one JSON object instead.

``packline bench loader`` runs the loader part alone (worker RSS, throughput and packing
overhead, the measured fill), on the real Energon loader only — no simulation.

The measurements live in :mod:`packline.bench`; this module prepares the default set through
the stages, calls them and prints.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packline.bench import CLUSTER_SEQ_LENGTH, SEQ_LENGTH
from packline.bench.lengths import vlm_sft_lengths, vlm_sft_rows
from packline.bench.simulation import cluster_packing, fill_summary, time_selection
from packline.bench.tables import print_loader_report, print_packing_tables
from packline.bench.targets import loader_targets, packing_targets
from packline.progress import console, stdout_to_stderr, wide_console
from packline.report.plots import plot_cluster_packing


@contextlib.contextmanager
def _measuring(as_json: bool) -> Iterator[None]:
    """What every loader benchmark runs under: Energon's loader asks for pinned memory and
    torch warns each time on a CPU-only machine (silenced); with ``--json`` all output but
    the JSON object goes to stderr."""
    with warnings.catch_warnings(), stdout_to_stderr(as_json):
        warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")
        yield


def _default_set(
    work_dir: Path, config: str | Path | None, overrides: list[str] | None = None
) -> tuple[Path, Path, list[int]]:
    """Prepare and connect the default set (``config`` with ``overrides``, e.g.
    ``data.video_share=1.0`` for a set of video conversations) under ``work_dir`` (skipped
    when up to date): what the loaders open (:func:`stages.base.dataset_path`), the processor
    dir and the train lengths."""
    import pandas as pd

    from packline.catalog import dataset_path, stage_dir

    # The stages are the only way to a prepared dataset; this entry point may use them.
    from schemas.config import load_config
    from stages.runner import run_stage

    cfg = load_config(config, [*(overrides or []), f"work_dir={work_dir}", "mlflow.enabled=false"])
    run_stage(cfg, "prepare")
    run_stage(cfg, "connect")
    df = pd.read_parquet(stage_dir(cfg, "connect") / "lengths.parquet")
    train = df[df["split"] == "train"]
    rows = [
        (int(n), [tuple(g) for g in json.loads(i)], [tuple(g) for g in json.loads(v)])
        for n, i, v in zip(
            train["total_tokens"], train["image_grids"], train["video_grids"], strict=True
        )
    ]
    return dataset_path(cfg), stage_dir(cfg, "connect") / "processor", rows


def _cluster_costs(rows: list[tuple[int, list, list]]) -> list[float]:
    """Each sample's FLOPs on the 8B cluster config's model (Qwen3-VL-8B, LoRA rank 32 on
    the attention and MLP linears), for the straggler figure."""
    from packline.counters import FlopsModel
    from packline.qwen.real_configs import real_config
    from schemas.choices import ATTENTION_PROJECTIONS, MLP_PROJECTIONS

    model = FlopsModel(
        config=real_config("qwen3-vl-8b"),
        lora_rank=32,
        lora_targets=(*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS),
    )
    return model.sample_flops(rows)


def bench_packing(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    seed: int = 0,
    num_vlm_samples: int = 20_000,
    num_select_lengths: int = 100_000,
    throughput_samples: int | None = None,
    throughput_rounds: int = 4,
) -> dict[str, Any]:
    """Run every measurement and print the tables (or, with ``as_json``, one JSON object).

    ``work_dir`` (default ``runs/bench``) holds the prepared default set of ``config``
    (default ``configs/tiny_cpu.yaml``). The throughput runs cover the first
    ``throughput_samples`` conversations of an epoch, default the whole epoch: only at the
    end of an epoch has the packed loader no lookahead — mid-epoch it has already
    pre-encoded up to a buffer more than it emitted, work the unpacked run has not done.
    The two throughput runs alternate for ``throughput_rounds`` rounds; each keeps its best
    (other load only ever slows a run). On this shared 2-core machine the overhead still
    reads between 3.3% and 6.0% from run to run on the same code.
    """
    from packline.bench.loader import measure_loader  # torch and Energon: import on use

    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / "bench"
    with _measuring(as_json):
        console.log(f"bench packing: default set under {work_dir}")
        dataset_path, processor_dir, default_rows = _default_set(work_dir, config, overrides)
        default_lengths = [n for n, _, _ in default_rows]

        result: dict[str, Any] = {}
        vlm_rows = vlm_sft_rows(num_vlm_samples, seed=seed)
        vlm = [n for n, _, _ in vlm_rows]
        for name, lengths in (("default", default_lengths), ("vlm_sft", vlm)):
            console.log(f"simulating the packer on {name} ({len(lengths):,} samples)")
            result[name] = fill_summary(lengths, capacity=SEQ_LENGTH, seed=seed)
        console.log(
            "eager_ffd@16 = lazy_ffd@16 in simulation by construction: both encoders give "
            "select_packs the same exact lengths"
        )
        result["cluster"] = {}
        for name, rows in (("default", default_rows), ("vlm_sft", vlm_rows)):
            console.log(f"Bridge's packer against packline's at {CLUSTER_SEQ_LENGTH} on {name}")
            result["cluster"][name] = cluster_packing(
                [n for n, _, _ in rows],
                capacity=CLUSTER_SEQ_LENGTH,
                seed=seed,
                costs=_cluster_costs(rows),
            )
        plot = plot_cluster_packing(result["cluster"], work_dir / "cluster_packing.png")
        console.log(f"cluster packing plot: {plot}")

        loader, loader_runs, throughput = measure_loader(
            dataset_path,
            processor_dir,
            num_samples=len(default_lengths),
            throughput_samples=throughput_samples,
            throughput_rounds=throughput_rounds,
        )
        result["default"]["fill"]["lazy_ffd@256.measured"] = loader.pop("fill_measured")
        result.update(loader)

        console.log(f"timing select_packs on {num_select_lengths:,} VLM-SFT lengths")
        select_s = time_selection(
            vlm_sft_lengths(num_select_lengths, seed=seed + 1), capacity=SEQ_LENGTH
        )
        result["select_100k_s"] = max(select_s.values())
        result["targets"] = packing_targets(result)

    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_packing_tables(
            wide_console(), result, loader_runs, throughput, select_s, num_select_lengths
        )
    return result


def bench_loader(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    throughput_samples: int | None = None,
    throughput_rounds: int = 4,
) -> dict[str, Any]:
    """The loader part of :func:`bench_packing` alone: worker RSS, the measured fill of
    lazy_ffd@256 through the real Energon loader, throughput and packing overhead.
    ``overrides`` change the set it runs on: ``data.video_share=1.0`` measures the eager
    and lazy workers on a buffer of video conversations (every frame decoded and its
    sampled patches held in eager mode, the encoded file held in lazy mode)."""
    from packline.bench.loader import measure_loader

    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / "bench"
    with _measuring(as_json):
        console.log(f"bench loader: default set under {work_dir}")
        dataset_path, processor_dir, lengths = _default_set(work_dir, config, overrides)
        result, loader_runs, throughput = measure_loader(
            dataset_path,
            processor_dir,
            num_samples=len(lengths),
            throughput_samples=throughput_samples,
            throughput_rounds=throughput_rounds,
        )
        result["targets"] = loader_targets(result)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_loader_report(wide_console(), result, loader_runs, throughput)
    return result


def bench_cluster_memory(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    bridge_path: str | Path | None = None,
    rounds: int = 2,
) -> dict[str, Any]:
    """Worker memory on the cluster path (:func:`packline.bench.cluster_memory.run_all`) on
    the default set, prepared and measured for ``train.backend=megatron`` under ``work_dir``
    (default ``runs/bench-cluster``); ``bridge_path`` holds Megatron-Bridge's data path (none:
    the installed Bridge)."""
    from packline.bench.cluster_memory import MEGATRON, run_all
    from packline.bench.tables import print_cluster_memory

    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / "bench-cluster"
    with _measuring(as_json):
        console.log(f"bench cluster-memory: the default set for Bridge under {work_dir}")
        _default_set(work_dir, config, [*(overrides or []), *MEGATRON])
        settings = [*(overrides or []), *MEGATRON, f"work_dir={work_dir}", "mlflow.enabled=false"]
        result = run_all(config, settings, bridge_path=bridge_path, rounds=rounds)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_cluster_memory(wide_console(), result, rounds)
    return result
