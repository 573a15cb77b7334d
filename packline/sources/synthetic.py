"""The built-in shapes set as a source: generated once into the work dir
(:func:`generate`), then read as a conversation folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packline.sources.jsonl import FolderReader
from schemas.config import PipelineConfig

SOURCE_DONE = "_SOURCE_COMPLETE"
"""Written into the built-in set's dir last, once its count check passed."""


def synthetic_source_dir(cfg: PipelineConfig) -> Path:
    """Where the built-in set of these settings is generated once (the generator's version in
    the name: a copy an older packline wrote is not reused)."""
    from packline.shapes.generate import SHAPES_VERSION

    d = cfg.data
    name = f"shapes-v{SHAPES_VERSION}-seed{d.seed}-train{d.num_train}-val{d.num_val}"
    return cfg.work_path / "source" / f"{name}-video{d.video_share:g}"


def generate(cfg: PipelineConfig) -> Path:
    """The built-in set of ``cfg`` generated once into the work dir (in a temp dir of this
    process, checked whole — every row and the media it names — before it is marked
    complete and renamed into place; a copy found incomplete is generated again)."""
    from packline.faults import discard_partial
    from packline.progress import console, progress
    from packline.shapes.generate import shapes_dataset_problem, write_shapes_dataset
    from packline.workdir import mark_owned, new_temp_dir, publish

    out = synthetic_source_dir(cfg)
    total = cfg.data.num_train + cfg.data.num_val
    if (out / SOURCE_DONE).is_file():
        problem = shapes_dataset_problem(out, num_rows=total)
        if problem is None:
            return out
        console.log(f"[yellow]the built-in set in {out} is incomplete ({problem}): regenerating[/]")
        mark_owned(out, "built-in set")  # its completion file says packline wrote it
    tmp = new_temp_dir(out.parent, f".tmp-{out.name}-")
    try:
        with progress() as bar:
            task = bar.add_task("generate shapes", total=total)
            write_shapes_dataset(
                tmp,
                num_train=cfg.data.num_train,
                num_val=cfg.data.num_val,
                seed=cfg.data.seed,
                video_share=cfg.data.video_share,
                progress=lambda n: bar.advance(task, n),
            )
        problem = shapes_dataset_problem(tmp, num_rows=total)
        assert problem is None, f"the built-in set just written is not whole: {problem}"
        (tmp / SOURCE_DONE).write_text(f"{total} rows\n")
        publish(tmp, out)
    except BaseException as exc:
        discard_partial(tmp, exc)
        raise
    return out


class SyntheticReader(FolderReader):
    """The generated set is a conversation folder; its settings are the data section's,
    already in prepare's fingerprint."""

    def fingerprint(self, cfg: PipelineConfig) -> list[Any]:
        return []

    def generate(self, cfg: PipelineConfig) -> Path:
        """:func:`generate` (what :func:`packline.sources.resolve_source` asks for)."""
        return generate(cfg)


SYNTHETIC = SyntheticReader()
