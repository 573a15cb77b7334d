"""Energon task encoders that pack Qwen3-VL conversations online.

Hook order per loader worker (Energon): ``preencode_sample`` (or ``encode_sample``) →
``select_samples_to_pack`` over the whole buffer → ``postencode_sample`` for the members
of each chosen group → ``pack_selected_samples`` → ``batch``.

- :class:`LazyQwenPackingEncoder`: before selection only the exact length is computed
  (tokenized text + image sizes from the file headers + each video's probed header);
  images are decoded and processed only for the conversations of a chosen group, and of a
  video only the frames the processor samples. The buffer holds token ids and encoded
  image and video bytes.
- :class:`EagerQwenPackingEncoder`: the full processor runs before selection, as
  Megatron-Bridge's encoder does (every frame of a video decoded); the buffer holds pixel
  tensors. Kept as the baseline.

With ``packing.max_carry_rounds`` > 0 both run under carry-over
(:class:`~packline.energon.carry.CarryOverPackingDataset`, installed by ``build_batch``):
a round's underfull packs wait in the reading buffer for a later round.

Rules kept here: ``select_samples_to_pack`` returns every sample it is given (Energon
clears the buffer each round and drops whatever is not in a group); an overlength
conversation is dropped *with a ledger entry* (or stops the run, per the overlength
policy); a malformed one is a counted skip under Energon's bounded failure tolerance; and
``batch`` enforces one packed row per micro-batch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.energon import Cooker, DefaultTaskEncoder, Sample, edataclass, stateless
from megatron.energon.errors import FatalSampleError

from packline.energon.carry import CarryOverBuild
from packline.energon.sample import CHATML_COOKER, ConversationSample, cook_conversation
from packline.packing.ledger import SKIPPED_ON_RESUME
from packline.packing.lengths import KeyLengths
from packline.packing.selection import align_up
from packline.packing.thd import EncodedConversation, PackedBatch, build_packed_batch
from packline.qwen.encode import ConversationEncoder, Tokenized


@dataclass(frozen=True, kw_only=True)
class PackingSettings:
    """What the encoder needs from ``packing`` (plain values, picklable into workers)."""

    seq_length: int
    alignment: int = 1
    algorithm: str = "ffd"
    pad_to_max_length: bool = False
    overlength: str = "drop"
    max_carry_rounds: int = 0
    seed: int = 0
    lengths_path: str | None = None
    """FLOPs balance (``packing.balance: flops``): connect's ``lengths.parquet``, whose
    per-sample FLOPs selection weighs; None: balance off."""

    @classmethod
    def from_config(cls, packing, seed: int = 0, lengths_path=None) -> PackingSettings:
        """``lengths_path``: connect's table, needed when ``packing.balance`` is ``flops``."""
        balance = packing.balance.value == "flops"
        if balance and lengths_path is None:
            raise ValueError("packing.balance flops weighs connect's FLOPs: pass lengths_path")
        return cls(
            seq_length=packing.seq_length,
            alignment=packing.alignment,
            algorithm=packing.algorithm.value,
            pad_to_max_length=packing.pad_to_max_length,
            overlength=packing.overlength.value,
            max_carry_rounds=packing.max_carry_rounds,
            seed=seed,
            lengths_path=str(lengths_path) if balance else None,
        )


@edataclass
class QwenConversation(Sample):
    """A conversation between encoding and packing."""

    #: Exact tokens of the conversation (image tokens included), before alignment.
    length: int
    #: Set when the conversation is dropped (the ledger's reason); it then carries no data.
    drop_reason: str | None
    #: Lazy mode: ids and targets, images still encoded.
    tokenized: Tokenized | None
    #: Eager mode, or lazy after ``postencode_sample``: ready for a row.
    encoded: EncodedConversation | None


@edataclass
class QwenPack(Sample):
    """One packed row (THD), the micro-batch the trainer consumes."""

    batch: PackedBatch


class _QwenPackingEncoder(
    CarryOverBuild, DefaultTaskEncoder[ConversationSample, QwenConversation, QwenPack, QwenPack]
):
    cookers = [CHATML_COOKER, Cooker(cook_conversation)]
    decoder = None  # images stay encoded bytes until they are needed

    def __init__(self, processor_dir, settings: PackingSettings):
        super().__init__()
        self.processor_dir = str(processor_dir)
        self.settings = settings
        self.max_carry_rounds = settings.max_carry_rounds
        self.carry_capacity = settings.seq_length
        self.carry_seed = settings.seed
        if settings.lengths_path is not None:
            self.balance = KeyLengths(settings.lengths_path)
            self.balance_target = self.balance.balance_target(
                capacity=settings.seq_length, alignment=settings.alignment
            )
        self._encoder: ConversationEncoder | None = None
        # Ledger entries of this worker not yet attached to a row.
        self._pending_seen = 0
        self.skip: Counter = Counter()
        """Keys to skip, each as many times as counted (set before the loader starts: a
        resume under another layout skips what the run before it trained)."""
        self._pending_dropped: dict[str, list[str]] = defaultdict(list)

    @property
    def encoder(self) -> ConversationEncoder:
        if self._encoder is None:  # loaded once per worker process
            self._encoder = ConversationEncoder(self.processor_dir)
        return self._encoder

    # -- helpers ----------------------------------------------------------------------------

    def _checked_length(self, sample: ConversationSample, length: int) -> str | None:
        """None when the conversation fits, else the drop reason (or stop, per policy)."""
        aligned = align_up(length, self.settings.alignment)
        if aligned <= self.settings.seq_length:
            return None
        if self.settings.overlength == "fail":
            raise FatalSampleError.from_sample(
                sample,
                f"conversation {sample.__key__} has {length} tokens (aligned {aligned}) > "
                f"packing.seq_length {self.settings.seq_length} and packing.overlength is "
                "'fail'; raise seq_length or set packing.overlength=drop",
            )
        return "overlength"

    def _dropped(self, sample: ConversationSample, length: int, reason: str) -> QwenConversation:
        return QwenConversation.derive_from(
            sample, length=length, drop_reason=reason, tokenized=None, encoded=None
        )

    def _skipped(self, sample: ConversationSample) -> QwenConversation | None:
        """The sample dropped as trained before the resume, if it is still to be skipped."""
        if self.skip[sample.__key__] <= 0:
            return None
        self.skip[sample.__key__] -= 1
        return self._dropped(sample, 0, SKIPPED_ON_RESUME)

    def _malformed(self, key: str) -> None:
        self._pending_dropped["malformed"].append(key)

    def packing_length(self, sample: QwenConversation) -> int | None:
        """The aligned length selection packs; None for a dropped sample (it rides along)."""
        if sample.drop_reason is not None:
            return None
        return align_up(sample.length, self.settings.alignment)

    # -- Energon hooks ----------------------------------------------------------------------

    def select_samples_to_pack(
        self, samples: list[QwenConversation]
    ) -> list[list[QwenConversation]]:
        """Every sample given is returned in exactly one group."""
        real = [s for s in samples if s.drop_reason is None]
        dropped = [s for s in samples if s.drop_reason is not None]
        groups = self.select_round(real, self.settings.algorithm, round_of=samples)
        out = [[real[i] for i in g] for g in groups]
        if dropped:  # ride along with a row so the ledger sees them
            if out:
                out[0].extend(dropped)
            else:
                out.append(dropped)
        assert sum(map(len, out)) == len(samples), "selection lost samples"
        return out

    def _measured(
        self,
        sample: ConversationSample,
        step: Callable[..., Any],
        fields: Callable[[Any], dict[str, Any]],
    ) -> QwenConversation:
        """What both encoders do to a sample before selection: count it, pass on what
        prepare rejected, run ``step`` (the tokenizer, or the whole processor) on its parts
        (a failure counts as ``malformed``), and drop what cannot fit; ``fields`` says where
        ``step``'s result goes in the :class:`QwenConversation`."""
        self._pending_seen += 1
        if skipped := self._skipped(sample):
            return skipped
        key = sample.__key__
        try:
            out = step(key, sample.conversation, sample.images, sample.videos, sample.video_headers)
        except Exception:
            self._malformed(key)
            raise
        reason = self._checked_length(sample, len(out))
        if reason:
            return self._dropped(sample, len(out), reason)
        return QwenConversation.derive_from(
            sample, length=len(out), drop_reason=None, **fields(out)
        )

    @stateless
    def pack_selected_samples(self, samples: list[QwenConversation]) -> QwenPack:
        dropped: dict[str, list[str]] = defaultdict(list)
        for reason, keys in self._pending_dropped.items():
            dropped[reason].extend(keys)
        self._pending_dropped.clear()
        convs = []
        for s in samples:
            if s.drop_reason is not None:
                dropped[s.drop_reason].append(s.__key__)
            else:
                convs.append(s.encoded)
        enc = self.encoder
        batch = build_packed_batch(
            convs,
            seq_length=self.settings.seq_length,
            alignment=self.settings.alignment,
            pad_to_max_length=self.settings.pad_to_max_length,
            pad_token_id=enc.pad_token_id,
            image_token_id=enc.image_token_id,
            video_token_id=enc.video_token_id,
            merge_size=enc.geometry.merge_size,
            dropped=dict(dropped),
            seen=self._pending_seen,
        )
        self._pending_seen = 0
        return QwenPack(
            __key__=",".join(batch.keys),
            __restore_key__=(),
            __subflavors__=samples[0].__subflavors__,
            __sources__=samples[0].__sources__,
            batch=batch,
        )

    def batch(self, samples: list[QwenPack]) -> QwenPack:
        """Physical micro-batch of exactly one packed row."""
        if len(samples) != 1:
            raise ValueError(
                f"a packed micro-batch holds exactly one row, got {len(samples)}: set "
                "train.micro_batch_size=1 (pack more conversations per row instead)"
            )
        return samples[0]


class LazyQwenPackingEncoder(_QwenPackingEncoder):
    """Cheap exact length before selection; images processed only once selected."""

    @stateless(failure_tolerance=100)
    def preencode_sample(self, sample: ConversationSample) -> QwenConversation:
        return self._measured(
            sample, self.encoder.tokenize, lambda tok: {"tokenized": tok, "encoded": None}
        )

    @stateless(failure_tolerance=100)
    def postencode_sample(self, sample: QwenConversation) -> QwenConversation:
        if sample.drop_reason is not None:
            return sample
        try:
            encoded = self.encoder.finish(sample.tokenized)
        except Exception:
            self._malformed(sample.__key__)
            raise
        return QwenConversation.derive_from(
            sample, length=sample.length, drop_reason=None, tokenized=None, encoded=encoded
        )


class EagerQwenPackingEncoder(_QwenPackingEncoder):
    """The full processor before selection (the Megatron-Bridge way)."""

    @stateless(failure_tolerance=100)
    def encode_sample(self, sample: ConversationSample) -> QwenConversation:
        return self._measured(
            sample, self.encoder.encode_eager, lambda enc: {"tokenized": None, "encoded": enc}
        )


def make_encoder(mode: str, processor_dir, settings: PackingSettings) -> _QwenPackingEncoder:
    """``lazy`` (default) or ``eager``."""
    if mode == "lazy":
        return LazyQwenPackingEncoder(processor_dir, settings)
    if mode == "eager":
        return EagerQwenPackingEncoder(processor_dir, settings)
    raise ValueError(f"unknown encoder mode {mode!r}: use 'lazy' or 'eager'")


def buffered_sample_bytes(
    mode: str,
    *,
    num_tokens: int,
    num_images: int,
    image_bytes: int,
    num_patches: int,
    patch_dim: int,
    num_videos: int = 0,
    video_bytes: int = 0,
    num_video_patches: int = 0,
) -> int:
    """Tensor bytes one conversation holds while it waits in a worker's packing buffer
    (payload only, not Python object overhead), per encoder mode:

    - ``lazy`` (:class:`~packline.qwen.encode.Tokenized`): ``input_ids`` (int64) and the
      target mask (bool) per token, plus its images and videos still as encoded file bytes;
    - ``eager`` (:class:`~packline.packing.thd.EncodedConversation`): the same ids and mask,
      3 M-RoPE rows (int64) per token, ``pixel_values`` and ``pixel_values_videos``
      (float32, ``patch_dim`` values per patch; a video's patches are its sampled frames',
      two frames per temporal patch) and the grids (3 int64 per image or video).

    Worked example (patch 16, temporal patch 2 → ``patch_dim`` = 3·2·16·16 = 1,536): 300
    tokens with one 32 KB image of 1,024 patches take 300·9 + 32,768 = 35,468 B lazy and
    300·33 + 1,024·1,536·4 + 24 = 6,301,380 B eager.
    """
    ids_and_mask = num_tokens * (8 + 1)
    if mode == "lazy":
        return ids_and_mask + image_bytes + video_bytes
    if mode == "eager":
        patches = num_patches + num_video_patches
        return (
            ids_and_mask
            + num_tokens * 3 * 8
            + patches * patch_dim * 4
            + (num_images + num_videos) * 24
        )
    raise ValueError(f"unknown encoder mode {mode!r}: use 'lazy' or 'eager'")
