"""Pretrain the tiny Qwen3-VL into a base for LoRA to adapt (``scripts/build-tiny-base``).

A LoRA fine-tune is meant to adapt a pretrained model, and none can be downloaded here, so
the project makes its own: the tiny dense Qwen3-VL (:func:`packline.qwen.model.build_tiny_model`)
trained in full, in fp32 on the CPU, from a seed, on a mix that is *not* the default
fine-tuning task (:func:`packline.shapes.generate.write_pretraining_set`: captions of the shapes
pictures, statements about shapes in words and text-only chat; nothing is asked about a
picture). The data goes the
way every packline run's does: prepare's shards, the lazy encoder, Energon's online packing
into rows of ``seq_length`` tokens, the packed forward with its per-token loss.

The result is an ordinary HF checkpoint dir (``config.json``, ``model.safetensors``,
``generation_config.json``) with the built-in processor saved beside it, and ``manifest.json``:
the command, seed, steps, threads, every step's loss and the weights' sha256.
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
    """What the base is made from; the manifest records every field."""

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


def _row_stream(dataset: Path, processor_dir: Path, s: PretrainSettings):
    settings = PackingSettings(seq_length=s.seq_length, algorithm="refined", seed=s.seed)
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
    out_dir: Path, s: PretrainSettings, *, dataset: Path, work_dir: Path, steps: int | None = None
) -> dict:
    """Pretrain on ``dataset`` (prepare's output over :func:`write_pretraining_set`'s rows;
    ``pipelines/tiny_base.py`` makes it) for ``steps`` (default ``s.steps``) and, when all of
    ``s.steps`` ran, save the checkpoint and its manifest to ``out_dir``. Returns the manifest
    (``losses`` per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        steps = s.steps if steps is None else steps
        return _pretrain(Path(out_dir), s, Path(dataset), Path(work_dir), steps)
    finally:
        torch.set_num_threads(threads)


def _pretrain(out_dir: Path, s: PretrainSettings, dataset: Path, work_dir: Path, steps: int):
    processor_dir = copy_tiny_processor(work_dir / "processor")
    processor = load_processor(processor_dir)
    ids = special_token_ids(processor)

    model = set_text_attention(build_tiny_model(processor, seed=s.seed), "thd")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: lr_lambda(i, warmup=s.warmup_steps, total=s.steps)
    )
    torch.manual_seed(s.seed)
    rows = _row_stream(dataset, processor_dir, s)
    losses: list[float] = []
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("pretraining the tiny base", total=steps)
        for _ in range(steps):
            batch = [next(rows) for _ in range(s.rows_per_step)]
            targets = sum(b.num_loss_tokens for b in batch)
            total = 0.0
            for b in batch:
                logits = packed_forward(
                    model,
                    b,
                    image_token_id=ids["image_token_id"],
                    video_token_id=ids.get("video_token_id"),
                )
                loss, _ = token_loss_sum(logits, b.labels)
                (loss / targets).float().backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total / targets)
            bar.update(task, advance=1, description=f"pretraining: loss {losses[-1]:.3f}")
    manifest = {
        "command": " ".join(["scripts/build-tiny-base", *sys.argv[1:]]),
        "settings": asdict(s),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "seconds": round(time.perf_counter() - t0, 1),
        "losses": losses,
    }
    if steps < s.steps:
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
