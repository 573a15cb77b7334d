"""Pretrain the tiny Qwen3-VL into a base for LoRA to adapt (``scripts/build-tiny-base``).

A LoRA fine-tune is meant to adapt a pretrained model, and none can be downloaded here, so
the project makes its own: the tiny dense Qwen3-VL (:func:`packline.qwen.model.build_tiny_model`)
trained in full, in fp32 on the CPU, from a seed, on a mix that is *not* the default
fine-tuning task (:func:`packline.shapes.generate.write_pretraining_set`: captions of the shapes
pictures, statements about shapes in words and text-only chat; nothing is asked about a
picture), optionally followed by a seeing phase on :data:`~packline.shapes.generate.SEEING_MIX`
(:class:`PretrainSettings` says what each phase is). The data goes the way every packline
run's does: prepare's shards, the lazy encoder, Energon's online packing
into rows of ``seq_length`` tokens, the packed forward with its per-token loss.

The result is an ordinary HF checkpoint dir (``config.json``, ``model.safetensors``,
``generation_config.json``) with the built-in processor saved beside it, and ``manifest.json``:
the command, every setting, the seconds, every step's loss of both phases and the weights'
sha256.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from packline.energon.loader import train_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.progress import progress
from packline.qwen.attention import set_text_attention
from packline.qwen.forward import packed_forward, token_loss_sum
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor, load_processor, special_token_ids
from packline.train.trainer import lr_lambda

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class PretrainSettings:
    """What the base is made from; the manifest records every field.

    Two phases, one after the other: ``steps`` on the first mix
    (:data:`~packline.shapes.generate.FIRST_MIX`: whole pictures, four caption styles, text),
    then ``seeing_steps`` on the seeing mix (:data:`~packline.shapes.generate.SEEING_MIX`:
    pictures cut to one or two shapes or of one large shape, the vision tower at
    ``vision_lr_scale`` times the rate), from a fresh optimizer and schedule."""

    steps: int = 900
    rows_per_step: int = 4
    """Packed rows of ``seq_length`` tokens per optimizer step."""
    seq_length: int = 2048
    lr: float = 4e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    num_rows: int = 8000
    """Pretraining conversations written (the stream repeats them when steps need more)."""
    packing_buffer_size: int = 64
    seed: int = 0
    threads: int = 2
    """torch intra-op threads: fixed, so the losses repeat bitwise on one machine kind."""
    seeing_steps: int = 0
    seeing_lr: float = 2e-3
    seeing_warmup_steps: int = 10
    vision_lr_scale: float = 3.0
    """The vision tower's learning rate over the rest's, in the seeing phase."""
    seeing_rows: int = 8000

    @property
    def total_steps(self) -> int:
        return self.steps + self.seeing_steps

    def first_phase(self) -> dict:
        """The fields the first phase depends on: a checkpoint saved with these is what the
        first phase of these settings makes."""
        names = ("steps", "rows_per_step", "seq_length", "lr", "warmup_steps", "weight_decay")
        names += ("num_rows", "packing_buffer_size", "seed", "threads")
        return {name: getattr(self, name) for name in names}


def _row_stream(dataset: Path, processor_dir: Path, s: PretrainSettings, seed: int):
    settings = PackingSettings(seq_length=s.seq_length, algorithm="refined", seed=seed)
    loader = train_loader(
        dataset,
        make_encoder("lazy", processor_dir, settings),
        packing_buffer_size=s.packing_buffer_size,
        shuffle_buffer_size=100,
        max_samples_per_sequence=100,
    )
    for pack in loader:
        if pack.batch.num_conversations:
            yield pack.batch


def pretrain(
    out_dir: Path,
    s: PretrainSettings,
    *,
    datasets: tuple[Path | None, Path | None],
    work_dir: Path,
    steps: int | None = None,
    first_phase: Path | None = None,
    checkpoint_every: int = 0,
) -> dict:
    """Pretrain on ``datasets`` (prepare's output over :func:`write_pretraining_set`'s rows of
    the first and the seeing mix; ``pipelines/tiny_base.py`` makes them) for ``steps``
    (default ``s.total_steps``) and, when all of them ran, save the checkpoint and its
    manifest to ``out_dir``. Returns the manifest (``losses`` per step, both phases).

    ``first_phase``: a checkpoint this script saved with ``s``'s first-phase fields and no
    seeing steps; the first phase is read from it (weights and losses) instead of rerun.
    ``checkpoint_every``: save the model under ``work_dir/checkpoints/step-N`` every N steps
    of the seeing phase, to probe while it runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        steps = s.total_steps if steps is None else steps
        return _pretrain(
            Path(out_dir), s, datasets, Path(work_dir), steps, first_phase, checkpoint_every
        )
    finally:
        torch.set_num_threads(threads)


def check_first_phase(path: Path, s: PretrainSettings) -> dict:
    """The manifest of a saved first phase, refused unless it says it is exactly ``s``'s first
    phase and the weights are the ones it recorded."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    saved = PretrainSettings(**manifest["settings"])
    if saved.seeing_steps or saved.first_phase() != s.first_phase():
        raise ValueError(
            f"{path} is not the first phase of these settings: it was built with "
            f"{manifest['settings']}, the first phase needs {s.first_phase()}"
        )
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    if digest != manifest["sha256"]:
        raise ValueError(f"{path}/model.safetensors is not the checkpoint its manifest records")
    return manifest


def load_first_phase(path: Path, s: PretrainSettings) -> tuple[torch.nn.Module, list[float], float]:
    """The model, losses and seconds of a saved first phase (:func:`check_first_phase`)."""
    from transformers import Qwen3VLForConditionalGeneration

    manifest = check_first_phase(path, s)
    model = Qwen3VLForConditionalGeneration.from_pretrained(Path(path), dtype=torch.float32)
    return model, list(manifest["losses"]), float(manifest["seconds"])


def _pretrain(
    out_dir: Path,
    s: PretrainSettings,
    datasets: tuple[Path | None, Path | None],
    work_dir: Path,
    steps: int,
    first_phase: Path | None,
    checkpoint_every: int,
):
    processor_dir = copy_tiny_processor(work_dir / "processor")
    processor = load_processor(processor_dir)
    ids = special_token_ids(processor)

    t0 = time.perf_counter()
    before = 0.0  # seconds of a first phase read from its checkpoint
    if first_phase is not None:
        model, losses, before = load_first_phase(first_phase, s)
    else:
        model, losses = build_tiny_model(processor, seed=s.seed), []
    model = set_text_attention(model, "thd")
    model.train()
    with progress() as bar:
        if first_phase is None:
            params = [p for p in model.parameters() if p.requires_grad]
            groups = [{"params": params, "lr": s.lr}]
            first = min(steps, s.steps)
            _phase(
                model,
                ids,
                groups,
                _row_stream(datasets[0], processor_dir, s, s.seed),
                s.warmup_steps,
                s.steps,
                first,
                s,
                losses,
                bar,
                "pretraining",
                seed=s.seed,
            )
        seeing = max(0, steps - s.steps)
        if seeing:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            vision = [p for n, p in named if ".visual." in f".{n}"]
            rest = [p for n, p in named if ".visual." not in f".{n}"]
            groups = [
                {"params": rest, "lr": s.seeing_lr},
                {"params": vision, "lr": s.seeing_lr * s.vision_lr_scale},
            ]
            rows = _row_stream(datasets[1], processor_dir, s, s.seed + 1)
            save = None
            if checkpoint_every:

                def save(step: int) -> None:
                    if step % checkpoint_every == 0:
                        dest = work_dir / "checkpoints" / f"step-{step}"
                        model.save_pretrained(dest, safe_serialization=True)
                        copy_tiny_processor(dest)

            _phase(
                model,
                ids,
                groups,
                rows,
                s.seeing_warmup_steps,
                s.seeing_steps,
                seeing,
                s,
                losses,
                bar,
                "seeing",
                seed=s.seed + 1,
                after_step=save,
            )
    manifest = {
        "command": " ".join(["scripts/build-tiny-base", *sys.argv[1:]]),
        "settings": asdict(s),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "seconds": round(before + time.perf_counter() - t0, 1),
        "losses": losses,
    }
    if first_phase is not None:
        manifest["first_phase_from"] = str(first_phase)
    if steps < s.total_steps:
        return manifest
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tiny_processor(out_dir)  # the built-in processor's files, as a checkpoint lays them out
    weights = out_dir / "model.safetensors"
    manifest["sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    manifest["bytes"] = weights.stat().st_size
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _phase(
    model, ids, groups, rows, warmup, total, steps, s, losses, bar, label, *, seed, after_step=None
):
    """``steps`` optimizer steps of one phase (a schedule of ``total`` steps), each over
    ``s.rows_per_step`` packed rows, the per-token loss over all their targets; appends each
    step's loss to ``losses``."""
    opt = torch.optim.AdamW(groups, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: lr_lambda(i, warmup=warmup, total=total)
    )
    params = [p for g in groups for p in g["params"]]
    torch.manual_seed(seed)
    task = bar.add_task(label, total=steps)
    for step in range(1, steps + 1):
        batch = [next(rows) for _ in range(s.rows_per_step)]
        targets = sum(b.num_loss_tokens for b in batch)
        total_loss = 0.0
        for b in batch:
            logits = packed_forward(
                model,
                b,
                image_token_id=ids["image_token_id"],
                video_token_id=ids.get("video_token_id"),
            )
            loss, _ = token_loss_sum(logits, b.labels)
            (loss / targets).float().backward()
            total_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total_loss / targets)
        bar.update(task, advance=1, description=f"{label}: loss {losses[-1]:.3f}")
        if after_step is not None:
            after_step(step)
