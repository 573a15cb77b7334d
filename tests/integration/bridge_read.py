"""Read a prepared dataset through Megatron-Bridge's own data path and print what it sees.

Run by ``test_bridge_reads_prepare.py`` in a subprocess whose ``PYTHONPATH`` holds
``tests.bridge_data.bridge_data_tree()`` (Bridge's data-path modules, unchanged) and the
project root::

    python tests/integration/bridge_read.py OVERRIDES_JSON OUT_JSON

``OVERRIDES_JSON`` holds packline's Bridge overrides (``packline.megatron.overrides``); their
``dataset.*`` keys are applied, with packline's ``apply_overrides``, to Bridge's own
``EnergonDatasetConfig`` and ``QwenVLEnergonTaskEncoderConfig``, and Bridge's own
``build_energon_task_encoder`` builds the encoder from them (``AutoTokenizer`` and
``Qwen3VLProcessor.from_pretrained`` of the processor dir, as on the cluster). Every sample of
both splits of ``dataset.path`` then goes through Energon with that encoder.

Two settings differ from the cluster run, both because the pinned wheel is 0.6.2 (the newest
release; native packing is on Bridge main only):

- per-sample rows instead of native packs: 0.6.2's encoder has no ``select_samples_to_pack``,
  so ``packing_buffer_size`` is unset and ``enable_in_batch_packing`` with multiple 1 makes its
  collate build each sample's THD row (``cu_seqlens``) — the very per-sample code main's
  native packing runs eagerly (``prepare_qwen_vl_sequence`` → ``_prepare_qwen_vl_sequence``);
- ``max_visual_tokens`` unset: 0.6.2's unpacked path pre-counts visual tokens by calling the
  processor with ``text=""``, which transformers 5.24 refuses; main skips that call under
  native packing and counts from the prepared grid, which this output reports.

Output: ``{"samples": {key: {...}}, "train_order", "buffer_size", "ffd_bins"}``: per sample,
its split, Bridge's sequence length, loss-token count, ``image_grid_thw`` and
``video_grid_thw`` rows, ``<|video_pad|>`` tokens, each image as Bridge's encoder receives it
(size and a digest of its RGB pixels) and each video as it receives it (frame count, frame
size and a digest of all its frames' RGB pixels), in order, and its conversation as Bridge's
normaliser reads it (each turn's role and parts, media where the sample places them); then
Bridge's own ``first_fit_decreasing`` (``data/packing/algorithms.py``, what main's
``select_samples_to_pack`` calls) over those lengths, one ``dataset.packing_buffer_size``
buffer at a time in the order Energon streamed the train split, as bins of lengths.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron.bridge.data.builders.energon import (
    EnergonDatasetConfig,
    QwenVLEnergonTaskEncoderConfig,
    build_energon_task_encoder,
)
from megatron.bridge.data.conversation_processing import (
    normalize_energon_vlm_sample,
    normalized_vlm_sample_to_hf_example,
)
from megatron.bridge.data.packing.algorithms import first_fit_decreasing
from megatron.energon import (
    DefaultTaskEncoder,
    WorkerConfig,
    get_loader,
    get_train_dataset,
    get_val_dataset,
)

from packline.megatron.overrides import apply_overrides


@dataclass
class _Root:
    """The one ConfigContainer section these overrides address."""

    dataset: EnergonDatasetConfig


class _Samples(DefaultTaskEncoder):
    """Bridge's samples as its dataset class loads them (one per batch, untouched)."""

    def batch(self, samples):
        return samples


def _dataset(path: Path, split: str, encoder):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    if split == "train":
        return get_train_dataset(
            path,
            split_part="train",
            worker_config=wc,
            batch_size=1,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            packing_buffer_size=None,
            repeat=False,
            task_encoder=encoder,
        )
    return get_val_dataset(
        path, split_part="val", worker_config=wc, batch_size=1, task_encoder=encoder
    )


def _digest(image) -> str:
    return hashlib.sha1(image.convert("RGB").tobytes()).hexdigest()


def _video(frames) -> list:
    """[frames, width, height, sha1 over every frame's RGB pixels] of one video."""
    digest = hashlib.sha1()
    for frame in frames:
        digest.update(frame.convert("RGB").tobytes())
    return [len(frames), *frames[0].size, digest.hexdigest()]


def _conversation(normalized) -> list:
    """[role, [text or part type, ...]] of each turn as Bridge's normaliser places the media
    (``media_first`` off: where the sample puts them), empty text left out."""
    turns = []
    for turn in normalized_vlm_sample_to_hf_example(normalized)["conversation"]:
        content = turn["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = [p["text"] if p["type"] == "text" else p["type"] for p in content]
        turns.append([turn["role"], [p for p in parts if p != ""]])
    return turns


def main(overrides_path: str, out_path: str) -> None:
    overrides = json.loads(Path(overrides_path).read_text())
    dataset = {k: v for k, v in overrides.items() if k.startswith("dataset.")}
    root = _Root(
        dataset=EnergonDatasetConfig(
            path=dataset["dataset.path"],
            seq_length=dataset["dataset.seq_length"],
            micro_batch_size=1,
            task_encoder=QwenVLEnergonTaskEncoderConfig(
                hf_processor_path=dataset["dataset.task_encoder.hf_processor_path"]
            ),
        )
    )
    apply_overrides(root, dataset)
    config = root.dataset
    buffer_size = config.packing_buffer_size
    # See the module docstring: per-sample rows from 0.6.2's collate.
    config.packing_buffer_size = None
    config.enable_in_batch_packing = True
    config.in_batch_packing_pad_to_multiple_of = 1
    config.task_encoder.max_visual_tokens = None
    config.validate()
    encoder = build_energon_task_encoder(config)
    video_pad = encoder.hf_tokenizer.convert_tokens_to_ids("<|video_pad|>")

    path = Path(config.path)
    samples: dict[str, dict] = {}
    for split in ("train", "val"):
        for batch in get_loader(_dataset(path, split, _Samples())):
            (sample,) = batch
            normalized = normalize_energon_vlm_sample(sample)
            samples[sample.__key__] = {
                "split": split,
                "sample_type": type(sample).__name__,
                "images": [[*image.size, _digest(image)] for image in normalized.images or []],
                "videos": [_video(frames) for frames in normalized.videos or []],
                "conversation": _conversation(normalized),
            }
        for batch in get_loader(_dataset(path, split, encoder)):
            (key,) = batch["__keys__"]
            visual = batch["visual_inputs"]
            grid = getattr(visual, "image_grid_thw", None) if visual is not None else None
            video_grid = getattr(visual, "video_grid_thw", None) if visual is not None else None
            length = int(batch["cu_seqlens_q"][-1])
            samples[key].update(
                length=length,
                loss_tokens=int(batch["loss_mask"].sum()),
                image_grids=grid.tolist() if grid is not None else [],
                video_grids=video_grid.tolist() if video_grid is not None else [],
                video_tokens=int((batch["input_ids"][0, :length] == video_pad).sum()),
            )
    # Bridge's own first-fit decreasing over its lengths, one packing buffer at a time, in the
    # order Energon streamed the train split (one worker, as read above)
    order = [k for k, v in samples.items() if v["split"] == "train"]
    lengths = [samples[k]["length"] for k in order]
    bins = []
    if buffer_size:
        for start in range(0, len(lengths), buffer_size):
            bins.append(
                first_fit_decreasing(lengths[start : start + buffer_size], config.seq_length)
            )
    out = {"samples": samples, "train_order": order, "buffer_size": buffer_size, "ffd_bins": bins}
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
