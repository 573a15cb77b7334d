"""packline's dataset for Megatron-Bridge: the cluster run packs with packline's packer
(``packing.packer: packline``). Imports ``megatron.bridge``: only in the container, or in a
test that runs Bridge main's data path from the vendored source.

:class:`PacklineEnergonDataset` is a dataclass subclass of Bridge's
``megatron.bridge.data.base.DatasetProvider``: Bridge's ``data/utils.py:get_dataset_provider``
finds no registered config type for it and returns its protocol adapter, which calls
:meth:`~PacklineEnergonDataset.build_datasets`. That builds Bridge's own
``EnergonMultiModalDataModule`` exactly as ``data/builders/energon.py:EnergonDatasetBuilder``
does, with :class:`~packline.megatron.task_encoder.PacklineQwenVLTaskEncoder` as the task
encoder, and returns its train loader and validation iterator.

Its fields carry ``EnergonDatasetConfig``'s names where they mean the same (``path``,
``seq_length``, ``packing_buffer_size``, ``task_encoder`` — Bridge's
``QwenVLEnergonTaskEncoderConfig``, ...), so every ``dataset.*`` override packline or a user
sends means the same with either packer; packline's own are ``lengths_path`` (connect's
table), ``algorithm``, ``max_carry_rounds``, ``seed`` and ``balance``.
:data:`~packline.megatron.overrides.PACKLINE_DATASET_FIELDS` lists them for the checks that
run without Bridge. Entry points: :func:`bridge_dataset` (the object for a loaded packline
config, what the megatron train stage sets as ``dataset``) and :func:`task_encoder` (the encoder
``build_datasets`` uses).

What Bridge does only for its own ``EnergonDatasetConfig`` (``training/config.py`` on main),
and where packline does it instead: Bridge's native-packing guardrails (micro-batch 1,
per-token loss, no collective averaging, no MTP or CUDA graphs, PP 1) are packline's Megatron
rules, checked by validate and again in the job; EP overlap and delayed wgrad are sent off by
packline's overrides; the CP/SP padding multiple goes in as
``in_batch_packing_pad_to_multiple_of`` (``packing.alignment``); ``pad_to_max_length`` is still
forced by Bridge for EP or PP > 1 (it checks the attribute, not the type), and the forward step
finds the THD boundaries in the batch (``cu_seqlens_q``) whatever the dataset type.

Bridge marks ``DatasetProvider`` a "deprecated compatibility contract". If a Bridge bump
removes it, the replacement is a registered builder: ``get_dataset_provider``'s ``_REGISTRY``
maps config types to provider functions with the signature of
``energon_train_valid_test_datasets_provider``; :meth:`~PacklineEnergonDataset.build_datasets`
is that function's body. ``tests/integration/test_bridge_packline_dataset.py`` imports the
protocol from the vendored source, so a bump that breaks it fails a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.bridge.data.builders.energon import QwenVLEnergonTaskEncoderConfig
from megatron.bridge.models.hf_pretrained.utils import is_safe_repo

from packline.megatron.overrides import bridge_overrides
from packline.megatron.task_encoder import PacklineQwenVLTaskEncoder
from packline.packing.lengths import KeyLengths
from packline.packing.selection import algorithm_named
from schemas.config import PipelineConfig

#: ``dataset_kwargs`` keys the builder owns (as ``EnergonDatasetConfig.validate`` refuses them).
_RESERVED_KWARGS = frozenset(
    {
        "batch_size",
        "max_samples_per_sequence",
        "packing_buffer_size",
        "shuffle_buffer_size",
        "split_part",
        "task_encoder",
        "worker_config",
    }
)


@dataclass(kw_only=True)
class PacklineEnergonDataset(DatasetProvider):
    """An Energon dataset packed by packline's packer (see the module docstring)."""

    path: str
    lengths_path: str
    """Connect's ``lengths.parquet``: every sample's exact length, as Bridge renders it."""
    seq_length: int
    task_encoder: QwenVLEnergonTaskEncoderConfig
    micro_batch_size: int = 1
    dataloader_type: Literal["external"] | None = "external"
    do_validation: bool = True
    num_val_workers: int | None = None
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int | None = None
    packing_buffer_size: int = 64
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    pad_to_max_length: bool = False
    in_batch_packing_pad_to_multiple_of: int = 1
    algorithm: str = "refined"
    """``packing.algorithm``: how each round is packed."""
    max_carry_rounds: int = 4
    """``packing.max_carry_rounds``: 0 turns carry-over off."""
    seed: int = 0
    """``train.seed``: seeds the order of each round's packs."""
    balance: str = "none"
    """``packing.balance``: ``flops`` balances each round's packs by connect's FLOPs."""

    def validate(self) -> None:
        if not self.path or not self.lengths_path:
            raise ValueError("PacklineEnergonDataset needs path and lengths_path")
        if self.micro_batch_size != 1:
            raise ValueError("packed rows: micro_batch_size must be 1")
        if self.seq_length <= 0 or self.packing_buffer_size <= 0:
            raise ValueError("seq_length and packing_buffer_size must be > 0")
        algorithm_named(self.algorithm)  # a ValueError naming the choices
        if self.max_carry_rounds < 0:
            raise ValueError("max_carry_rounds must be >= 0")
        if self.balance not in ("none", "flops"):
            raise ValueError(f"balance {self.balance!r} is not 'none' or 'flops'")
        reserved = _RESERVED_KWARGS & set(self.dataset_kwargs)
        if reserved:
            raise ValueError(f"dataset_kwargs cannot set {', '.join(sorted(reserved))}")
        self.task_encoder.validate()

    def finalize(self) -> None:
        super().finalize()
        self.validate()

    def build_task_encoder(self) -> PacklineQwenVLTaskEncoder:
        """The encoder :meth:`build_datasets` uses: Bridge's tokenizer and processor loads
        (as ``build_energon_task_encoder`` does for ``QwenVLEnergonTaskEncoderConfig``)."""
        from transformers import AutoTokenizer, Qwen3VLProcessor

        t = self.task_encoder
        trust = is_safe_repo(
            trust_remote_code=(
                t.trust_remote_code if t.trust_remote_code is not None else self.trust_remote_code
            ),
            hf_path=t.hf_processor_path,
        )
        load = {"revision": t.hf_processor_revision, "trust_remote_code": trust}
        return PacklineQwenVLTaskEncoder(
            lengths=KeyLengths(self.lengths_path),
            algorithm=self.algorithm,
            max_carry_rounds=self.max_carry_rounds,
            seed=self.seed,
            balance=self.balance == "flops",
            tokenizer=AutoTokenizer.from_pretrained(t.hf_processor_path, **load),
            image_processor=Qwen3VLProcessor.from_pretrained(t.hf_processor_path, **load),
            temporal_patch_size=t.temporal_patch_size,
            spatial_merge_size=t.spatial_merge_size,
            patch_size=t.patch_size,
            max_padding_length=self.seq_length,
            min_pixels=t.min_pixels,
            max_pixels=t.max_pixels,
            max_num_images=t.max_num_images,
            max_num_frames=t.max_num_frames,
            max_visual_tokens=t.max_visual_tokens,
            pad_to_max_length=self.pad_to_max_length,
            in_batch_packing_pad_to_multiple_of=self.in_batch_packing_pad_to_multiple_of,
        )

    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any, Any, None]:
        """Train loader and validation iterator, as ``EnergonDatasetBuilder.build`` makes
        them, over packline's encoder."""
        from megatron.bridge.data.energon.base_energon_datamodule import (
            EnergonMultiModalDataModule,
        )

        build_train = context.train_samples > 0
        build_validation = self.do_validation and context.valid_samples > 0
        encoder = self.build_task_encoder() if build_train or build_validation else None
        datamodule = EnergonMultiModalDataModule(
            path=self.path,
            tokenizer=context.tokenizer,
            seq_length=self.seq_length,
            task_encoder=encoder,
            validation_task_encoder=encoder,
            micro_batch_size=self.micro_batch_size,
            num_workers=self.num_workers,
            num_val_workers=self.num_val_workers,
            pin_memory=self.pin_memory,
            shuffle_buffer_size=self.shuffle_buffer_size,
            max_samples_per_sequence=self.max_samples_per_sequence,
            packing_buffer_size=self.packing_buffer_size,
            pg_collection=context.pg_collection,
            **self.dataset_kwargs,
        )
        train = datamodule.train_dataloader() if build_train else None
        validation = iter(datamodule.val_dataloader()) if build_validation else None
        return train, validation, None


def bridge_dataset(cfg: PipelineConfig) -> PacklineEnergonDataset:
    """packline's dataset for ``cfg`` (a loaded packline config): every ``dataset.*`` value of
    :func:`~packline.megatron.overrides.bridge_overrides`, extra overrides included."""
    from packline.megatron.overrides import apply_overrides

    values = {
        k.removeprefix("dataset."): v
        for k, v in bridge_overrides(cfg).items()
        if k.startswith("dataset.")
    }
    dataset = PacklineEnergonDataset(
        path=values["path"],
        lengths_path=values["lengths_path"],
        seq_length=values["seq_length"],
        task_encoder=QwenVLEnergonTaskEncoderConfig(
            hf_processor_path=values["task_encoder.hf_processor_path"]
        ),
    )
    apply_overrides(dataset, values)
    return dataset


def task_encoder(cfg: PipelineConfig) -> PacklineQwenVLTaskEncoder:
    """The task encoder packline's dataset builds for ``cfg``."""
    return bridge_dataset(cfg).build_task_encoder()


def bridge_stock_encoder(dataset: PacklineEnergonDataset) -> Any:
    """Bridge's own ``QwenVLTaskEncoder`` on the same settings, made by Bridge's own builder
    (``build_energon_task_encoder`` of an ``EnergonDatasetConfig``): what ``packing.packer:
    bridge`` trains with, for comparisons."""
    from megatron.bridge.data.builders.energon import (
        EnergonDatasetConfig,
        build_energon_task_encoder,
    )

    return build_energon_task_encoder(
        EnergonDatasetConfig(
            path=dataset.path,
            seq_length=dataset.seq_length,
            micro_batch_size=1,
            task_encoder=dataset.task_encoder,
            packing_buffer_size=dataset.packing_buffer_size,
            pad_to_max_length=dataset.pad_to_max_length,
            in_batch_packing_pad_to_multiple_of=dataset.in_batch_packing_pad_to_multiple_of,
        )
    )
