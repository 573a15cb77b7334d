"""Megatron-Bridge's Qwen-VL task encoder with packline's packing: what the cluster run packs
with (``packing.packer: packline``). Imports ``megatron.bridge``: only in the container, or in
a test that runs Bridge main's data path from the vendored source.

:class:`PacklineQwenVLTaskEncoder` subclasses Bridge main's ``QwenVLTaskEncoder`` and keeps
its ``encode_sample``, ``pack_selected_samples``, ``batch`` and ``encode_batch`` as they are,
so Bridge's forward step, THD metadata and mRoPE see exactly the tensors Bridge's own encoder
makes of the same samples (the tests compare them bitwise). What changes is when and what is
selected:

- **Lazy exact lengths.** ``preencode_sample`` looks the sample up in connect's
  ``lengths.parquet`` (measured as Bridge renders it: images before each turn's text,
  qwen-vl-utils' resize, the task encoder's geometry) and keeps only its key, restore key and
  length: no pixel waits in the buffer. A key connect never measured stops the run with the
  key and the fix (never a guess). What Bridge's ``encode_sample`` skips it skips the same
  way, from connect's figures: more images than ``max_num_images`` or more visual tokens than
  ``max_visual_tokens`` (``SkipSample``), an aligned length over ``seq_length`` (a
  ``ValueError`` under Energon's failure tolerance). ``postencode_sample`` reads the chosen
  sample again through Energon's restore key (the reader below the pre-encode step, so the
  same decoded sample Bridge's encoder would get), runs Bridge's ``encode_sample`` on it and
  checks the length it made is connect's.
- **packline's selection.** ``select_samples_to_pack`` runs
  :func:`~packline.packing.selection.select_packs` with ``packing.algorithm`` (``refined``
  by default) over the aligned lengths, where Bridge runs plain first-fit decreasing; with
  ``packing.balance: flops`` the packs are then balanced by connect's per-sample FLOPs
  (:mod:`packline.packing.balance`).
- **Carry-over.** ``build_batch`` installs
  :class:`~packline.energon.carry.CarryOverPackingDataset` (``max_carry_rounds`` > 0), the
  same wrapper the local backend's encoder uses.

The price of an empty buffer: Bridge's ``ChatMLWebdataset`` decodes a sample's images when it
reads it, so a packed sample's images are decoded twice (when it is read, then when it is read
again after selection); the processor still runs once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.bridge.data.energon.task_encoder_utils import ChatMLSample
from megatron.bridge.models.qwen_vl.data.energon import QwenVLTaskEncoder, QwenVLTaskSample
from megatron.energon import Sample, SkipSample, edataclass, stateless
from megatron.energon.errors import FatalSampleError
from megatron.energon.task_encoder.base import get_failure_tolerance
from megatron.energon.wrappers import MapDataset

from packline.energon.carry import CarryOverBuild
from packline.packing.lengths import KeyLengths
from packline.packing.selection import align_up


@edataclass
class MeasuredSample(Sample):
    """A sample in a packing buffer: its key, restore key and exact length (connect's)."""

    length: int


class PacklineQwenVLTaskEncoder(CarryOverBuild, QwenVLTaskEncoder):
    """Bridge's ``QwenVLTaskEncoder`` with lazy lengths, packline's selection and carry-over
    (see the module docstring). ``bridge`` are ``QwenVLTaskEncoder``'s own arguments; native
    packing is always on."""

    def __init__(
        self,
        *,
        lengths: KeyLengths,
        algorithm: str = "refined",
        max_carry_rounds: int = 4,
        seed: int = 0,
        balance: bool = False,
        **bridge: Any,
    ):
        super().__init__(enable_energon_packing=True, **bridge)
        self.lengths = lengths
        self.algorithm = algorithm
        self.max_carry_rounds = max_carry_rounds
        self.carry_capacity = self.seq_length
        self.carry_seed = seed
        if balance:  # FLOPs balance: connect's figures again, by key
            self.balance = lengths
            self.balance_target = lengths.balance_target(
                capacity=self.seq_length, alignment=self.in_batch_packing_pad_to_multiple_of
            )

    def build_encode_sample(self, dataset, *, worker_config):
        """``preencode_sample`` before the buffer. (Energon refuses a pre-encode hook beside
        an ``encode_sample`` it did not define, and Bridge's class defines one: here it runs
        after selection, from ``postencode_sample``.) The stage is kept: its source reads a
        chosen sample again."""
        self._measured = MapDataset(
            dataset,
            self.preencode_sample,
            worker_config=worker_config,
            stateless_map_fn=True,
            failure_tolerance=get_failure_tolerance(
                self.preencode_sample, self.__default_failure_tolerance__
            ),
        )
        return self._measured

    def _read_again(self, sample: MeasuredSample) -> ChatMLSample:
        """The Energon sample behind a buffered one, read again by its restore key (the
        pre-encode stage's key minus its own two entries)."""
        key = sample.__restore_key__
        if not key or key[0] != type(self._measured).__name__:
            raise RuntimeError(f"sample {sample.__key__!r}: unexpected restore key {key!r}")
        return self._measured.dataset.restore_sample(key[2:])

    def packing_length(self, sample: MeasuredSample) -> int:
        """The length a sample takes in a row: its exact length aligned to the CP/SP multiple."""
        return align_up(sample.length, self.in_batch_packing_pad_to_multiple_of)

    @stateless(failure_tolerance=100)
    def preencode_sample(self, sample: ChatMLSample) -> MeasuredSample:
        measured = self.lengths.get(sample.__key__)
        if measured is None:
            raise FatalSampleError.from_sample(
                sample,
                f"sample {sample.__key__!r} has no length in connect's table "
                f"{self.lengths.path}: the dataset is not the one connect measured. Rerun "
                "connect on it (packline stage connect <config>), or set packing.packer=bridge",
            )
        # Bridge's encode_sample skips these (its own checks, on connect's figures)
        if self.max_num_images is not None and measured.num_images > self.max_num_images:
            raise SkipSample()
        if self.max_visual_tokens is not None and measured.visual_tokens > self.max_visual_tokens:
            raise SkipSample()
        aligned = align_up(measured.length, self.in_batch_packing_pad_to_multiple_of)
        if aligned > self.seq_length:
            raise ValueError(
                f"Sample {sample.__key__} aligned sequence length {aligned} "
                f"exceeds seq_length={self.seq_length}."
            )
        return MeasuredSample(
            __key__=sample.__key__,
            __restore_key__=sample.__restore_key__,
            __subflavors__=sample.__subflavors__,
            __sources__=sample.__sources__,
            length=measured.length,
        )

    @stateless(failure_tolerance=100)
    def postencode_sample(self, sample: MeasuredSample) -> QwenVLTaskSample:
        encoded = self.encode_sample(self._read_again(sample))  # Bridge's own
        made = encoded.prepared_sequence.sequence_length
        if made != sample.length:
            raise FatalSampleError.from_sample(
                sample,
                f"sample {sample.__key__!r}: connect measured {sample.length} tokens, Bridge's "
                f"encoder made {made}: lengths.parquet was measured with another processor or "
                "geometry. Rerun connect with this config",
            )
        # The restore key of the buffered sample (Energon restores packs through it).
        return dataclasses.replace(encoded, __restore_key__=sample.__restore_key__)

    def select_samples_to_pack(self, samples: list[MeasuredSample]) -> list[list[MeasuredSample]]:
        """Every sample in exactly one group, chosen by ``packing.algorithm`` (and FLOPs
        balance)."""
        return [[samples[i] for i in g] for g in self.select_round(samples, self.algorithm)]
