"""What a stage's completion record is keyed by: a hash of everything the stage's outputs
depend on, chained to the hash of the stage it reads, so that a change anywhere upstream
reruns every stage after it and nothing else does (prepare <- connect <- validate, and
connect <- train). One home for the chain: each stage asks :func:`stage_fingerprint` for its
own, and the runner for every stage's, without any stage importing another.

Each stage's own part: prepare, the data and prepare sections, the processor's geometry,
the user's source (every file's path, size and mtime) and its output layout; connect, the
processor section and dir (its bytes), and the packing settings the forecast uses; validate,
every setting a rule reads and the model's ``config.json``; train, its sections (the local
run's parallel layout aside: any layout resumes any other's checkpoints) and the model
checkpoint's files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import packline
from packline.backends import backend
from packline.qwen.processor import image_geometry, tiny_processor_key, video_geometry
from packline.sources import hash_tree
from schemas.config import PipelineConfig

#: Bumped when the layout of prepare's outputs changes, so older outputs are rebuilt.
PREPARE_LAYOUT_VERSION = 3  # 3: videos (<key>.vid<k>.<ext>, "videos" headers, video columns)
#: The stage each stage reads, whose fingerprint its own is chained to.
UPSTREAM: dict[str, str | None] = {
    "prepare": None,
    "connect": "prepare",
    "validate": "connect",
    "train": "connect",
}


def fingerprint(*parts: Any) -> str:
    """sha256 over JSON of ``parts`` plus the packline version."""
    payload = json.dumps([packline.__version__, *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _prepare(cfg: PipelineConfig) -> list[Any]:
    from packline.sources import reader

    source = reader(cfg.data.kind).fingerprint(cfg)
    # for train.backend megatron prepare writes each video's pre-sampled frames
    bridge = ["bridge-frames"] if backend(cfg).renders_for_bridge else []
    geometry, videos = image_geometry(cfg), video_geometry(cfg)
    return [
        cfg.section_hash("data", "prepare"),
        geometry,
        videos,
        source,
        PREPARE_LAYOUT_VERSION,
        *bridge,
    ]


def _connect(cfg: PipelineConfig) -> list[Any]:
    from packline.megatron.overrides import max_num_frames

    src = cfg.processor.dir  # a dir, or a Hub repo's cached snapshot
    bridge = backend(cfg).renders_for_bridge  # measured as Bridge renders
    return [
        cfg.section_hash("processor"),
        hash_tree(src, content=True) if src else f"tiny-{tiny_processor_key()}",
        {
            "seq_length": cfg.packing.seq_length,
            "alignment": cfg.packing.alignment,
            "algorithm": cfg.packing.algorithm.value,
            "buffers": list(cfg.packing.forecast_buffer_sizes),
            "seed": cfg.train.seed,
            "bridge": bridge,
            # Bridge keeps the first max_num_frames frames of a video: measured so
            **({"max_num_frames": max_num_frames(cfg)} if bridge else {}),
        },
    ]


def _validate(cfg: PipelineConfig) -> list[Any]:
    d = cfg.to_dict()
    settings = {k: v for k, v in d.items() if k not in ("name", "work_dir", "mlflow", "executor")}
    slurm = d["executor"]["slurm"]  # what the SLURM and Megatron rules read of the executor
    settings["executor"] = {
        "kind": d["executor"]["kind"],
        **{k: slurm[k] for k in ("nodes", "gpus_per_node", "nproc_per_node")},
    }
    model_json = cfg.model.dir / "config.json" if cfg.model.dir is not None else None
    model_hash = (
        hashlib.sha256(model_json.read_bytes()).hexdigest()
        if model_json is not None and model_json.is_file()
        else None
    )
    return [settings, model_hash]


def _train(cfg: PipelineConfig) -> list[Any]:
    # The backend's sections (the local run's layout aside: any layout resumes any other's
    # checkpoints), and the checkpoint's files (path, size, mtime): a base rebuilt at the
    # same path retrains, and the old run's adapters are not resumed onto it.
    model_dir = cfg.model.dir
    weights = hash_tree(model_dir) if model_dir is not None and model_dir.is_dir() else None
    return [backend(cfg).train_settings(cfg), weights]


_OWN = {"prepare": _prepare, "connect": _connect, "validate": _validate, "train": _train}


def stage_fingerprint(cfg: PipelineConfig, stage: str) -> str:
    """The fingerprint ``stage``'s completion record must hold for the stage to be up to
    date under ``cfg``: its own inputs, chained to its upstream stage's fingerprint."""
    upstream = UPSTREAM[stage]
    chain = [stage_fingerprint(cfg, upstream)] if upstream is not None else []
    return fingerprint(*chain, *_OWN[stage](cfg))
