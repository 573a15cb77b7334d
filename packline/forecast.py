"""The forecast of a config's run: how its train backend's loader reads and packs
(:func:`forecast_settings`, :func:`data_parallel_ranks`), put to the simulator of
:mod:`packline.packing.forecast` over connect's lengths table. connect writes the result
(:func:`config_forecast`, ``forecast.json``, with :func:`forecast_flops`'s FLOPs of an epoch
packed and unpacked); validate, train and the pipeline's console read it back
(:func:`packline.catalog.read_forecast`). The simulator stays on integers; this module knows
the config, the processor and the FLOPs model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packline.backends import backend
from packline.packing.forecast import forecast_fill, simulate_packing, straggler_ratio, stream_order
from packline.packing.selection import align_up

if TYPE_CHECKING:
    import pandas as pd

    from schemas.config import PipelineConfig


def data_parallel_ranks(cfg: PipelineConfig) -> int:
    """Data-parallel ranks ``cfg``'s train backend reads data with (Energon's
    ``WorkerConfig.world_size``; each has ``train.num_workers`` loader workers): its
    spec's (:meth:`packline.backends.Backend.data_parallel_ranks`)."""
    return backend(cfg).data_parallel_ranks(cfg)


def forecast_settings(cfg: PipelineConfig, costs: list[float] | None = None) -> dict[str, Any]:
    """How the forecast simulates ``cfg``'s packer (``simulate_packing``'s keywords): the
    train backend, its packer's selection, carry-over and FLOPs balance
    (:meth:`packline.backends.Backend.forecast_packer`; with balance, the samples' ``costs``
    in the order the lengths are given) and its loader streams, ranks ×
    ``train.num_workers``."""
    spec = backend(cfg)
    packer = spec.forecast_packer(cfg)
    return {
        "backend": spec.name.value,
        "algorithm": packer["algorithm"],
        "max_carry_rounds": packer["max_carry_rounds"],
        "costs": costs if packer["balance"] else None,
        "num_ranks": spec.data_parallel_ranks(cfg),
        "num_workers": cfg.train.num_workers,
    }


def sample_costs(cfg: PipelineConfig, processor_dir: Path, lengths: pd.DataFrame) -> list[float]:
    """Each sample's executed FLOPs alone at its aligned length, for connect's lengths table
    (its ``flops`` column): ``FlopsModel.sample_flops`` of ``cfg``'s model."""
    from packline.counters import flops_model_for  # the model's config: torch, lazily
    from packline.qwen.processor import load_processor

    model = flops_model_for(cfg, load_processor(processor_dir))
    m = cfg.packing.alignment
    return model.sample_flops(
        [
            (
                align_up(int(n), m),
                [tuple(g) for g in json.loads(ig)],
                [tuple(g) for g in json.loads(vg)],
            )
            for n, ig, vg in zip(
                lengths["total_tokens"], lengths["image_grids"], lengths["video_grids"], strict=True
            )
        ]
    )


def forecast_flops(
    cfg: PipelineConfig, processor_dir: Path, train: pd.DataFrame
) -> dict[str, float]:
    """FLOPs and tokens of one training epoch with packing on (the packs
    :func:`forecast_fill` forecasts at the configured buffer, same stream) and off
    (``train.unpacked_micro_batch_size`` conversations padded to the longest), before any
    training. Useful FLOPs are the same both ways; what packing saves is the padding. And
    the packed epoch's :func:`straggler_ratio` over the config's data-parallel ranks.
    ``train``: connect's lengths table, train rows (its ``flops`` column: :func:`sample_costs`)."""
    from packline.counters import flops_model_for  # the model's config: torch, lazily
    from packline.qwen.processor import load_processor

    model = flops_model_for(cfg, load_processor(processor_dir))
    p = cfg.packing
    costs = train["flops"].tolist()
    rows = [
        (
            int(n),
            [tuple(g) for g in json.loads(grids)],
            int(loss),
            [tuple(g) for g in json.loads(vg)],
        )
        for n, grids, loss, vg in zip(
            train["total_tokens"],
            train["image_grids"],
            train["loss_tokens"],
            train["video_grids"],
            strict=True,
        )
    ]
    order = stream_order(len(rows), cfg.train.seed)
    ordered = [rows[i] for i in order]
    costs = [costs[i] for i in order]
    simulated = simulate_packing(
        [align_up(n, p.alignment) for n, *_ in ordered],
        capacity=p.seq_length,
        buffer_size=p.packing_buffer_size,
        **forecast_settings(cfg, costs),
    )
    stream = [row for row in ordered if align_up(row[0], p.alignment) <= p.seq_length]
    useful = sum(model.useful([n], grids, n, loss, video_grids=vg) for n, grids, loss, vg in stream)

    packed_exec = packed_rows = packed_real = 0
    for g in (g for r in simulated.rounds for g in r.groups):
        segments = [simulated.lengths[i] for i in g]  # aligned
        if p.pad_to_max_length:
            segments[-1] += p.seq_length - sum(segments)
        grids = [grid for i in g for grid in ordered[i][1]]
        video_grids = [grid for i in g for grid in ordered[i][3]]
        packed_exec += model.executed(segments, grids, video_grids=video_grids)
        packed_rows += 1
        packed_real += sum(ordered[i][0] for i in g)

    k = cfg.train.unpacked_micro_batch_size
    unpacked_exec = unpacked_rows = unpacked_capacity = 0
    for start in range(0, len(stream), k):
        chunk = stream[start : start + k]
        longest = max(n for n, *_ in chunk)
        grids = [grid for _, gs, _, _ in chunk for grid in gs]
        video_grids = [grid for *_, vgs in chunk for grid in vgs]
        unpacked_exec += model.executed([longest] * len(chunk), grids, video_grids=video_grids)
        unpacked_rows += len(chunk)
        unpacked_capacity += longest * len(chunk)

    # how evenly the data-parallel ranks' steps cost: one optimizer step is the global batch
    # of packed rows, split over the ranks
    ranks = data_parallel_ranks(cfg)
    straggler = straggler_ratio(
        simulated,
        costs,
        num_ranks=ranks,
        packs_per_step=max(cfg.train.global_batch_size // ranks, 1),
    )

    packed_capacity = packed_rows * p.seq_length
    return {
        "straggler_ratio": straggler,
        "straggler_ranks": float(ranks),
        "epoch_useful": float(useful),
        "epoch_executed_packed": float(packed_exec),
        "epoch_executed_unpacked": float(unpacked_exec),
        "epoch_nominal_packed": float(model.nominal(packed_capacity)),
        "epoch_nominal_unpacked": float(model.nominal(unpacked_capacity)),
        "padding_share_packed": 1 - useful / packed_exec if packed_exec else 0.0,
        "padding_share_unpacked": 1 - useful / unpacked_exec if unpacked_exec else 0.0,
        "saving": 1 - packed_exec / unpacked_exec if unpacked_exec else 0.0,
        "rows_packed": float(packed_rows),
        "rows_unpacked": float(unpacked_rows),
        "tokens_real": float(packed_real),
        "tokens_capacity_packed": float(packed_capacity),
        "tokens_capacity_unpacked": float(unpacked_capacity),
    }


def config_forecast(
    cfg: PipelineConfig, processor_dir: Path, train: pd.DataFrame
) -> dict[str, Any]:
    """connect's ``forecast.json`` for ``cfg``: :func:`forecast_fill` of its packer
    (:func:`forecast_settings`) over connect's lengths table's ``train`` rows at
    ``packing.forecast_buffer_sizes``, the overlength count, the alignment and
    :func:`forecast_flops`."""
    m = cfg.packing.alignment
    aligned = [align_up(int(n), m) for n in train["total_tokens"]]
    settings = forecast_settings(cfg, train["flops"].tolist())
    forecast = forecast_fill(
        aligned,
        cfg.packing.seq_length,
        list(cfg.packing.forecast_buffer_sizes),
        settings.pop("algorithm"),
        cfg.train.seed,
        **settings,
    )
    forecast["overlength"] = len(aligned) - forecast["samples"]
    forecast["alignment"] = m
    forecast["flops"] = forecast_flops(cfg, processor_dir, train)
    return forecast
