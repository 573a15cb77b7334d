"""What the config refuses before anything runs: values that would run as shell, and data
where a run replaces or writes (schemas/safety.py, via load_config and validate's rules)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from schemas.config import load_config
from schemas.errors import UserError
from schemas.rules import CONFIG_RULES
from schemas.safety import bad_name, unsafe_reason

HOSTILE = ["a;touch p", "$(touch p)", "`touch p`", "a b", "a\nb", "a|b", "a&b", "a>b", "50%x"]


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(UserError) as exc:
        load_config(None, list(overrides))
    return exc.value.problems


@pytest.mark.parametrize("value", HOSTILE)
def test_unsafe_reason_names_the_character_and_its_kind(value):
    why = unsafe_reason(value)
    assert why is not None
    bad = next(ch for ch in value if not (ch.isalnum() or ch in "/_.-"))
    assert why.startswith(f"{bad!r} at character {value.index(bad) + 1} (")


@pytest.mark.parametrize("value", ["runs/my_run-1", "/data/a,b:c=d+e@f~g", "données/été"])
def test_unsafe_reason_passes_plain_paths(value):
    assert unsafe_reason(value) is None


@pytest.mark.parametrize("name", ["x;y", "-x", ".x", "a b", "x/y", "", "é"])
def test_bad_name_refuses_anything_but_the_name_pattern(name):
    assert bad_name(name) is not None
    assert bad_name("my-run_2.v3") is None


def test_every_unsafe_setting_is_refused_at_once_with_its_setting_and_fix(tmp_path: Path):
    problems = _problems(
        "name=x$(id)",
        f"work_dir={tmp_path / 'w;rm'}",
        "processor.path=/tmp/a b",
        "model.path=/tmp/`x`",
        "executor.slurm.account=acct;x",
        "executor.slurm.container_mounts=[/a:/a,'/b c:/b']",
        "executor.slurm.env={OK: fine, X: $HOME, 'BAD NAME': y}",
        "executor.slurm.job_dir=/j|k",
    )
    by_setting = {p.split(" ", 1)[0] for p in problems}
    assert {
        "name",
        "work_dir",
        "processor.path",
        "model.path",
        "executor.slurm.account",
        "executor.slurm.container_mounts[1]",
        "executor.slurm.env.X",
        "executor.slurm.env.BAD",
        "executor.slurm.job_dir",
    } <= by_setting, problems
    # one row each (processor.path also breaks its section's own rule: not a directory)
    assert all("; fix: " in p for p in problems if "is not a directory" not in p)
    assert not any("executor.slurm.env.OK" in p for p in problems)
    assert not any("container_mounts[0]" in p for p in problems)


def test_a_glob_in_data_source_is_no_shell_but_the_rest_still_is(tmp_path: Path):
    """data.source travels in the config file only; its glob is Python's (Parquet files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"conversations": [[]]}), tmp_path / "d" / "train-0.parquet")
    cfg = load_config(None, [f"work_dir={tmp_path / 'w'}", f"data.source={tmp_path}/d/*.parq?et"])
    assert cfg.data.kind.value == "parquet"
    problems = _problems(f"work_dir={tmp_path / 'w'}", f"data.source={tmp_path}/d;x/*.parquet")
    assert any(p.startswith("data.source ") and "';' at character" in p for p in problems)


def test_a_bad_name_is_reported_once_not_again_as_its_work_dir():
    problems = _problems("name=a b")
    assert [p.split(" ", 1)[0] for p in problems] == ["name"]


def test_a_work_dir_resolving_under_an_unsafe_dir_is_refused(tmp_path: Path):
    target = tmp_path / "my runs"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    problems = _problems(f"work_dir={tmp_path / 'link' / 'w'}")
    assert problems[0].startswith("work_dir ") and "(whitespace)" in problems[0]


def test_a_default_work_dir_under_an_unsafe_current_dir_is_refused(tmp_path: Path):
    cwd = tmp_path / "my;dir"
    cwd.mkdir()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        problems = _problems()
    finally:
        os.chdir(here)
    assert problems[0].startswith(f"work_dir '{cwd}/runs/tiny_cpu': ';' at character")


def _folder(root: Path) -> Path:
    root.mkdir(parents=True)
    row = {"id": "a", "conversations": [{"role": "user", "content": "hi"}]}
    (root / "conversations.jsonl").write_text(json.dumps(row) + "\n")
    return root


def _energon(root: Path) -> Path:
    (root / ".nv-meta").mkdir(parents=True)
    (root / ".nv-meta" / "dataset.yaml").write_text("__class__: CrudeWebdataset\n")
    return root


def _llava(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[]")
    return path


@pytest.mark.parametrize(
    "make, where, setting",
    [
        (_folder, "prepare/data", "data.source"),
        (_energon, "connect/ds", "data.source"),
        (lambda p: _llava(p / "mix.json"), "train/llava", "data.source"),
        (_folder, "source/mine", "data.source"),
        (_folder, "connect.parts/x", "data.source"),
    ],
    ids=["folder", "energon", "llava", "source-dir", "connect-parts"],
)
def test_a_source_inside_a_dir_a_run_replaces_is_refused(tmp_path, make, where, setting):
    work = tmp_path / "work"
    source = make(work / where)
    problems = _problems(f"work_dir={work}", f"data.source={source}")
    assert problems[0].startswith(f"{setting} '{source}' lies inside {work / where.split('/')[0]}")
    assert "it would be deleted; fix: move it out of" in problems[0]


def test_a_llava_media_dir_inside_a_stage_dir_is_refused(tmp_path: Path):
    work = tmp_path / "work"
    media = work / "validate" / "images"
    media.mkdir(parents=True)
    source = _llava(tmp_path / "mix.json")
    problems = _problems(f"work_dir={work}", f"data.source={source}", f"data.media_dir={media}")
    assert problems[0].startswith(f"data.media_dir '{media}' lies inside {work / 'validate'}")


@pytest.mark.parametrize("kind", ["folder", "energon", "llava-folder"])
def test_a_work_dir_inside_the_data_is_refused(tmp_path: Path, kind):
    data = tmp_path / "data"
    if kind == "folder":
        source = _folder(data)
    elif kind == "energon":
        source = _energon(data)
    else:  # the LLaVA file's own folder is its media dir
        source = _llava(data / "mix.json")
    problems = _problems(f"work_dir={data / 'runs'}", f"data.source={source}")
    assert problems[0].startswith(f"work_dir '{data / 'runs'}' lies inside data.")
    assert f"fix: choose a work_dir outside {data}" in problems[0]


def test_a_stage_dir_that_is_a_symlink_is_refused(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    elsewhere = _folder(tmp_path / "precious")
    (work / "prepare").symlink_to(elsewhere)
    problems = _problems(f"work_dir={work}")
    assert problems[0].startswith(f"work_dir: {work / 'prepare'} is a symbolic link (to ")
    assert (elsewhere / "conversations.jsonl").is_file()


def test_the_processor_inside_its_own_work_dirs_connect_is_refused(tmp_path: Path):
    work = tmp_path / "work"
    processor = work / "connect" / "processor"
    processor.mkdir(parents=True)
    problems = _problems(f"work_dir={work}", f"processor.path={processor}")
    assert problems[0].startswith(f"processor.path '{processor}' lies inside")


def test_the_rules_are_in_validates_book_and_hold_on_the_default_config(tmp_path: Path):
    cfg = load_config(None, [f"work_dir={tmp_path / 'w'}"])
    findings, checks = CONFIG_RULES.run(cfg)
    status = {c.rule: c.status for c in checks}
    assert status["config.shell_safe"] == "ok"
    assert status["config.data_placement"] == "ok"
    assert findings == []
