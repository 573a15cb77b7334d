"""A folder source's media files are looked at before a byte is read, and a fault of one file
rejects its row, never the stage: real files through the real prepare.

- a 3 GiB file named as an image is ``image_size_refused`` over ``prepare.max_media_bytes``
  without being read (the CLI's peak RSS stays far below the file's size);
- a FIFO named as an image is ``image_unreadable`` and is never opened (the stage ends);
- a loop of symbolic links is ``image_unreadable``;
- an image the user may not read (mode 000, root without the capabilities that override file
  modes) is ``image_unreadable``, the other rows accepted, the file untouched;
- a missing image whose name differs from a file's only in Unicode normalisation (NFC in the
  row, NFD on disk) is ``missing_image`` naming that file;
- an image with an EXIF orientation is measured (connect) and prepared with its stored
  pixels, as Qwen's reference loader (qwen-vl-utils' ``fetch_image``) reads it, and counted
  (``prepare/image_exif_oriented``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import unicodedata
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from packline.qwen.vision import ImageGeometry
from stages.connect import connect
from stages.prepare import prepare
from tests.conftest import make_config, png_bytes
from tests.integration.test_bad_input import LENIENT, _accepted_ids, _rejects
from tests.machine import run_cli, sha256_tree

pytestmark = pytest.mark.slow  # the over-size, FIFO and permission cases run the CLI

GOOD = ("g0", "g1", "g2")


def _row(sid: str, images: list[str]) -> str:
    conv = [
        {"role": "user", "content": "<image>" * len(images) + "What is it?"},
        {"role": "assistant", "content": "A disc."},
    ]
    return json.dumps({"id": sid, "images": images, "conversations": conv}, ensure_ascii=False)


def _folder(tmp_path: Path, bad: dict[str, str]) -> Path:
    """A folder of the :data:`GOOD` rows (one PNG each) and one row per ``bad`` item (id →
    the image path it names; the test makes that file)."""
    folder = tmp_path / "data"
    folder.mkdir()
    rows = []
    for k, sid in enumerate(GOOD):
        (folder / f"{sid}.png").write_bytes(png_bytes((48 + 16 * k, 48), "red"))
        rows.append(_row(sid, [f"{sid}.png"]))
    rows += [_row(sid, [path]) for sid, path in bad.items()]
    (folder / "conversations.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


def _cli_prepare(
    tmp_path: Path, folder: Path, **kwargs
) -> tuple[subprocess.CompletedProcess, Path]:
    work = tmp_path / "cli"
    args = [
        "stage", "prepare", f"work_dir={work}", f"data.source={folder}",
        "prepare.max_reject_fraction=1", "prepare.num_workers=1", "mlflow.enabled=false",
    ]  # fmt: skip
    return run_cli(args, **kwargs), work / "prepare"


#: Runs ``run_cli`` in a fresh interpreter and prints its exit and the peak RSS of its
#: process tree (``ru_maxrss`` of the waited-for descendants, KiB): nothing else of this
#: interpreter's children is counted.
_MEASURE = """
import json, resource, sys
from tests.machine import run_cli
done = run_cli(json.loads(sys.argv[1]), timeout=300)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": done.returncode, "stderr": done.stderr[-3000:], "peak_kib": peak}))
"""


def test_prepare_rejects_a_file_unread_when_it_is_over_max_media_bytes(tmp_path: Path):
    folder = _folder(tmp_path, {"big": "big.png"})
    with open(folder / "big.png", "wb") as f:
        f.truncate(3 * 2**30)  # sparse: no disk, yet 3 GiB to read
    work = tmp_path / "cli"
    args = [
        "stage", "prepare", f"work_dir={work}", f"data.source={folder}",
        "prepare.max_reject_fraction=1", "prepare.num_workers=1", "mlflow.enabled=false",
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    probe = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(args)],
        capture_output=True, text=True, cwd=root, timeout=330,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    done = json.loads(probe.stdout.splitlines()[-1])
    peak_mib = done["peak_kib"] / 1024
    print(f"peak RSS of `packline stage prepare` with a 3 GiB image: {peak_mib:.0f} MiB")
    assert done["rc"] == 0, done["stderr"]
    out = work / "prepare"
    assert _rejects(out) == {
        "big": (
            "image_size_refused",
            "'big.png': 3,221,225,472 bytes, over prepare.max_media_bytes 1,073,741,824",
        )
    }
    assert _accepted_ids(out) == set(GOOD)
    assert peak_mib < 1.5 * 1024, peak_mib


def test_prepare_rejects_without_blocking_when_an_image_is_a_fifo(tmp_path: Path):
    folder = _folder(tmp_path, {"pipe": "pipe.png"})
    os.mkfifo(folder / "pipe.png")  # opening it to read would wait for a writer forever
    done, out = _cli_prepare(tmp_path, folder, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _rejects(out) == {
        "pipe": ("image_unreadable", "'pipe.png' is a FIFO (named pipe), not a regular file")
    }
    assert _accepted_ids(out) == set(GOOD)


def test_prepare_rejects_the_row_when_an_image_is_a_loop_of_symbolic_links(tmp_path: Path):
    folder = _folder(tmp_path, {"loop": "a.png"})
    (folder / "a.png").symlink_to("b.png")
    (folder / "b.png").symlink_to("a.png")
    out = prepare(make_config(tmp_path / "work", f"data.source={folder}", *LENIENT))
    assert _rejects(out.out_dir) == {
        "loop": ("image_unreadable", "'a.png' is a loop of symbolic links")
    }
    assert _accepted_ids(out.out_dir) == set(GOOD)
    assert out.metrics["prepare/rejected_image_unreadable"] == 1


def test_prepare_rejects_the_row_when_the_user_may_not_read_an_image(tmp_path: Path):
    folder = _folder(tmp_path, {"locked": "locked.png"})
    (folder / "locked.png").write_bytes(png_bytes((64, 48), "blue"))
    (folder / "locked.png").chmod(0)
    before = sha256_tree(folder)
    done, out = _cli_prepare(tmp_path, folder, without_dac=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reason, detail = _rejects(out)["locked"]
    assert reason == "image_unreadable"
    assert detail.startswith("'locked.png': permission denied (mode 000, owner uid 0)"), detail
    assert _accepted_ids(out) == set(GOOD)
    assert sha256_tree(folder) == before
    assert (folder / "locked.png").stat().st_mode & 0o777 == 0


def test_missing_image_names_the_file_when_the_names_differ_in_normalisation(tmp_path: Path):
    nfc = unicodedata.normalize("NFC", "café.png")
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfc != nfd
    folder = _folder(tmp_path, {"accent": nfc})
    (folder / nfd).write_bytes(png_bytes((64, 48), "green"))  # as copied from macOS
    out = prepare(make_config(tmp_path / "work", f"data.source={folder}", *LENIENT))
    assert _rejects(out.out_dir) == {
        "accent": (
            "missing_image",
            f"image {nfc!r} does not exist; a file named {nfd!r} differs from it only in "
            "Unicode normalisation (NFC vs NFD): rename the file or the path in the row",
        )
    }
    assert _accepted_ids(out.out_dir) == set(GOOD)


def _jpeg_with_orientation(width: int, height: int, orientation: int) -> bytes:
    img = Image.new("RGB", (width, height), "grey")
    img.paste("red", (0, 0, width // 2, height))  # left half red: a turn would show
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    return buf.getvalue()


def test_images_keep_their_stored_pixels_when_exif_says_to_turn_them(tmp_path: Path):
    folder = _folder(tmp_path, {"turned": "turned.jpg"})
    turned = _jpeg_with_orientation(64, 32, 6)  # 6: a viewer turns it 90° to 32x64
    (folder / "turned.jpg").write_bytes(turned)
    with Image.open(folder / "turned.jpg") as img:
        assert img.size == (64, 32) and img.getexif()[0x0112] == 6
    cfg = make_config(tmp_path / "work", f"data.source={folder}", "mlflow.enabled=false")
    prepared = prepare(cfg)
    assert prepared.metrics["prepare/image_exif_oriented"] == 1
    assert prepared.metrics["prepare/rows_accepted"] == len(GOOD) + 1
    connect(cfg)

    manifest = pd.read_parquet(prepared.out_dir / "manifest.parquet").set_index("id")
    lengths = pd.read_parquet(cfg.work_path / "connect" / "lengths.parquet").set_index("key")
    assert set(lengths.index) == set(manifest["key"])
    key = manifest.loc["turned", "key"]
    row = lengths.loc[key]
    assert row["num_images"] == manifest.loc["turned", "num_images"] == 1
    stored = ImageGeometry().grid_thw(32, 64)  # height 32, width 64: as stored
    assert stored != ImageGeometry().grid_thw(64, 32)
    assert json.loads(row["image_grids"]) == [list(stored)]
    # The shard holds the file's own bytes, EXIF tag and all.
    members = {}
    for shard in prepared.out_dir.glob("*.tar"):
        with tarfile.open(shard) as tar:
            members.update({m.name: tar.extractfile(m).read() for m in tar.getmembers()})
    assert members[f"{key}.img0.jpg"] == turned
