"""Loader factory over Energon's ``get_train_dataset`` / ``get_val_dataset`` and
``get_savable_loader``, one per data-parallel rank."""

from __future__ import annotations

import warnings
from pathlib import Path

from megatron.energon import (
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
)

from packline.energon.sample import ConversationReader


def quiet_pin_memory() -> None:
    """Energon's loaders ask torch for pinned memory; on a machine without an accelerator
    torch warns at every loader it builds. Ignore that one message (idempotent: the filter
    is added once)."""
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")


def train_loader(
    dataset_path: Path,
    encoder,
    *,
    packing_buffer_size: int | None,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    repeat: bool = True,
    shuffle_buffer_size: int | None = None,
    max_samples_per_sequence: int | None = None,
    seed_offset: int = 0,
):
    """A savable loader of packed rows (one per micro-batch) for DP rank ``rank``."""
    worker_config = WorkerConfig(
        rank=rank, world_size=world_size, num_workers=num_workers, seed_offset=seed_offset
    )
    dataset = get_train_dataset(
        Path(dataset_path),
        split_part="train",
        worker_config=worker_config,
        batch_size=1,
        packing_buffer_size=packing_buffer_size,
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence,
        task_encoder=encoder,
        repeat=repeat,
    )
    quiet_pin_memory()
    return get_savable_loader(dataset, checkpoint_every_min_n_samples=1, n_checkpoints=None)


def val_loader(
    dataset_path: Path, encoder, *, packing_buffer_size: int | None, num_workers: int = 0
):
    """The val split once, packed the same way (rank 0 of 1)."""
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
    dataset = get_val_dataset(
        Path(dataset_path),
        split_part="val",
        worker_config=worker_config,
        batch_size=1,
        packing_buffer_size=packing_buffer_size,
        task_encoder=encoder,
    )
    quiet_pin_memory()
    return get_savable_loader(dataset)


def read_conversations(dataset_path: Path, split: str = "val"):
    """Every sample of ``split`` once, one by one, in its fixed order, media still encoded
    (:class:`~packline.energon.sample.ConversationReader`): what ``packline chat`` replays
    and the trainer's answer accuracy asks."""
    dataset = get_val_dataset(
        Path(dataset_path),
        split_part=split,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        task_encoder=ConversationReader(),
    )
    quiet_pin_memory()
    for batch in get_loader(dataset):
        yield batch[0]
