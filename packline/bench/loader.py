"""The real Energon loader measured: the RSS of its worker, its throughput with and without
packing, and the fill it emits.

Each run builds its own loader and releases it before returning; the workers are checked to
have exited (:func:`~packline.bench.processes.wait_for_exit`), so every RSS run's worker is
the only new child.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from packline.bench import SEQ_LENGTH
from packline.bench.processes import WorkerRss, child_pids, wait_for_exit
from packline.energon.loader import train_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.progress import progress

#: Packed loader runs whose worker RSS is sampled: (encoder mode, buffer size). eager@16 is
#: the small buffer an eager encoder affords; eager@256 and lazy@256 hold the same samples,
#: as pixel tensors (every image's patches, every video's sampled frames) or as encoded files.
RSS_RUNS = (("eager", 16), ("eager", 256), ("lazy", 256), ("lazy", 1024))
#: Packing buffer of the packed throughput runs.
THROUGHPUT_BUFFER = 256


@dataclass(kw_only=True)
class LoaderRun:
    """What one pass of the loader gave."""

    num_items: int  # packs, or conversations without packing
    num_samples: int  # conversations out of the loader, dropped ones included
    real_tokens: int
    seconds: float  # from the first ``next`` to the last item kept
    peak_rss_mb: float | None = None
    first_rss_mb: float | None = None  # worker RSS when the first item arrived
    start_rss_mb: float | None = None  # worker RSS when first seen, right after the fork
    worker_pids: tuple[int, ...] = field(default=())  # the workers seen, all exited since


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``num_threads`` inside the block.

    >>> before = torch.get_num_threads()
    >>> with torch_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_loader(
    dataset_path: Path,
    processor_dir: Path,
    *,
    mode: str,
    buffer_size: int | None,
    num_workers: int,
    max_samples: int | None = None,
    watch_worker: bool = False,
    description: str,
    total: int | None = None,
    seq_length: int = SEQ_LENGTH,
) -> LoaderRun:
    """One epoch (or the first ``max_samples`` conversations) of the train loader over the
    prepared dataset, with ``mode``'s encoder and packing buffer ``buffer_size`` (None: no
    packing, one conversation per item). With ``watch_worker`` the workers' RSS is polled.

    The loader lives only inside this call: when it returns, the workers have exited
    (RuntimeError if they have not within 30 s)."""
    baseline = child_pids()
    run = _one_pass(
        dataset_path,
        processor_dir,
        mode=mode,
        buffer_size=buffer_size,
        num_workers=num_workers,
        max_samples=max_samples,
        watch_worker=watch_worker,
        description=description,
        total=total,
        seq_length=seq_length,
    )
    # Energon keeps the workers for the next epoch (persistent workers): they end when torch's
    # worker iterator is finalized, which happens when the loader is freed. The loader and its
    # epoch generator reference each other, so only a collection frees them.
    gc.collect()
    wait_for_exit(baseline)
    return run


def _one_pass(
    dataset_path: Path,
    processor_dir: Path,
    *,
    mode: str,
    buffer_size: int | None,
    num_workers: int,
    max_samples: int | None,
    watch_worker: bool,
    description: str,
    total: int | None,
    seq_length: int,
) -> LoaderRun:
    """:func:`run_loader`'s pass; the loader is referenced only from this frame."""
    encoder = make_encoder(mode, processor_dir, PackingSettings(seq_length=seq_length))
    encoder.encoder  # noqa: B018 - load the processor now, outside the timing (forks inherit it)
    loader = train_loader(
        dataset_path,
        encoder,
        packing_buffer_size=buffer_size,
        num_workers=num_workers,
        repeat=False,
    )
    num_items = num_samples = real_tokens = 0
    first_rss = None
    with (
        progress() as bar,
        WorkerRss() if watch_worker else contextlib.nullcontext() as watcher,
    ):
        task = bar.add_task(description, total=max_samples or total)
        t0 = time.perf_counter()
        for item in loader:
            num_items += 1
            if buffer_size is None:  # a QwenConversation, through batch() of one
                n = 1
                if item.drop_reason is None:
                    assert item.encoded is not None, "postencode_sample did not run"
                    real_tokens += item.length
            else:  # a QwenPack
                b = item.batch
                n = b.num_conversations + sum(len(keys) for keys in b.dropped.values())
                real_tokens += b.num_real_tokens
            num_samples += n
            if watcher and first_rss is None:
                first_rss = watcher.sample()
            bar.advance(task, n)
            if max_samples is not None and num_samples >= max_samples:
                break
        seconds = time.perf_counter() - t0
    return LoaderRun(
        num_items=num_items,
        num_samples=num_samples,
        real_tokens=real_tokens,
        seconds=seconds,
        peak_rss_mb=watcher.peak_mb if watcher else None,
        first_rss_mb=first_rss,
        start_rss_mb=watcher.start_mb if watcher else None,
        worker_pids=tuple(sorted(watcher.pids)) if watcher else (),
    )


def measure_loader(
    dataset_path: Path,
    processor_dir: Path,
    *,
    num_samples: int,
    throughput_samples: int | None = None,
    throughput_rounds: int = 4,
    seq_length: int = SEQ_LENGTH,
) -> tuple[dict[str, Any], dict[str, LoaderRun], dict[str, list[LoaderRun]]]:
    """The real loader on a prepared set of ``num_samples`` train conversations: worker RSS
    of :data:`RSS_RUNS` (one epoch each, one worker), the measured fill of lazy_ffd@256,
    and throughput without and with packing (alternated rounds, best of each). Returns
    (figures, the RSS runs, the throughput runs).

    The throughput runs cover the first ``throughput_samples`` conversations of an epoch
    (None: the whole epoch), in the main process with one torch thread."""
    if throughput_rounds < 1:
        raise ValueError(f"throughput_rounds must be >= 1, got {throughput_rounds}")
    rss: dict[str, float] = {}
    growth: dict[str, float] = {}
    loader_runs: dict[str, LoaderRun] = {}
    for mode, b in RSS_RUNS:
        name = f"{mode}_ffd@{b}"
        run = run_loader(
            dataset_path,
            processor_dir,
            mode=mode,
            buffer_size=b,
            num_workers=1,
            watch_worker=True,
            description=f"worker RSS {name}",
            total=num_samples,
            seq_length=seq_length,
        )
        if run.num_samples != num_samples:
            raise RuntimeError(
                f"{name}: one epoch gave {run.num_samples} conversations, the set has {num_samples}"
            )
        loader_runs[name] = run
        rss[name] = run.peak_rss_mb
        growth[name] = run.peak_rss_mb - run.first_rss_mb
    measured = loader_runs["lazy_ffd@256"]
    result: dict[str, Any] = {
        "fill_measured": measured.real_tokens / (measured.num_items * seq_length),
        "worker_rss_mb": rss,
        "worker_rss_growth_mb": growth,
    }

    # Alternated rounds, best of each: other load on the machine only ever slows a run.
    # Single-threaded torch, as in every DataLoader worker: with intra-op threads, the
    # row's pixel copy in the main process measures thread hand-offs, not packing.
    packed_name = f"lazy_ffd@{THROUGHPUT_BUFFER}"
    throughput: dict[str, list[LoaderRun]] = {"encode_only": [], packed_name: []}
    for round_ in range(1, throughput_rounds + 1):
        for name, buffer_size in (("encode_only", None), (packed_name, THROUGHPUT_BUFFER)):
            with torch_threads(1):
                run = run_loader(
                    dataset_path,
                    processor_dir,
                    mode="lazy",
                    buffer_size=buffer_size,
                    num_workers=0,
                    max_samples=throughput_samples,
                    description=f"throughput {name} ({round_}/{throughput_rounds})",
                    total=num_samples,
                    seq_length=seq_length,
                )
            throughput[name].append(run)
    counts = {run.num_samples for runs in throughput.values() for run in runs}
    if len(counts) != 1:
        raise RuntimeError(
            f"throughput runs differ in conversations ({sorted(counts)}): use a "
            f"throughput_samples that ends a buffer of {THROUGHPUT_BUFFER}"
        )
    speed = {
        name: max(run.num_samples / run.seconds for run in runs)
        for name, runs in throughput.items()
    }
    result["samples_per_s"] = speed
    result["packing_overhead"] = 1 - speed[packed_name] / speed["encode_only"]
    return result, loader_runs, throughput
