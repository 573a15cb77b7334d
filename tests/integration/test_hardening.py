"""packline as a hostile or careless user meets it: the real CLI in subprocesses, real files.

- config values never run as shell, and nothing is written outside the work dir;
- a user's data where a stage publishes, or a stage dir packline did not make, is refused
  (exit 2) and left byte for byte as it was;
- one writer per work dir: a second invocation is refused naming the first, or waits; a lock
  left by a killed process is taken over and its temp dirs removed; a partial built-in set
  is found and generated again;
- a failed stage stops ``packline run``: the later stages never start.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from packline.workdir import LOCK_ENV, LOCK_NAME, hold, holder, is_owned, publish
from pipelines.slurm_jobs import listing_command
from schemas.config import PROJECT_ROOT
from schemas.errors import UserError
from tests.integration.chatml_dataset import write_chatml_dataset

pytestmark = pytest.mark.slow

PACKLINE = [sys.executable, "-m", "pipelines.cli"]
SMALL = ["data.num_train=40", "data.num_val=4", "prepare.num_workers=1"]


def _env() -> dict[str, str]:
    """This process's environment without a work dir lock it may hold (a child with it
    would work under that lock)."""
    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    env["COLUMNS"] = "200"
    return env


def _cli(*args: str, cwd: Path = PROJECT_ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PACKLINE, *args], capture_output=True, text=True, env=_env(), cwd=cwd, timeout=timeout
    )


def _popen(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*PACKLINE, *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=PROJECT_ROOT,
        start_new_session=True,
    )


def _snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: sha256, size and mtime."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        out[str(path.relative_to(root))] = (
            hashlib.sha256(path.read_bytes()).hexdigest(),
            st.st_size,
            st.st_mtime_ns,
        )
    return out


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


# --- no shell from config values --------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    ["x;touch {s};", "x$(touch {s})", "x`touch {s}`", "x {s}"],
    ids=["semicolon", "dollar-paren", "backticks", "space"],
)
@pytest.mark.parametrize("setting", ["name", "work_dir"])
def test_dryrun_with_shell_in_a_value_runs_nothing_and_writes_nothing(tmp_path, setting, payload):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    sentinel = tmp_path / "SENTINEL"
    value = payload.format(s=sentinel)
    if setting == "work_dir":
        value = str(tmp_path / "runs" / value)
    before = _tree(tmp_path)
    result = _cli(
        "run",
        f"{setting}={value}",
        "executor.slurm.account=acct",
        "executor.slurm.nproc_per_node=1",
        "--executor",
        "slurm",
        "--dryrun",
        cwd=cwd,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"  - {setting} " in result.stderr and "; fix: " in result.stderr
    assert "Traceback" not in result.stderr
    assert not sentinel.exists()
    assert _tree(tmp_path) == before  # no work dir, no tar, nothing anywhere


def test_a_checkout_path_with_shell_in_it_is_refused_before_submitting(tmp_path: Path):
    """NeMo-Run's packager ships the checkout with a shell command: a checkout whose path
    holds shell syntax is refused, not shipped."""
    import shutil

    sentinel = tmp_path / "SENTINEL"
    checkout = tmp_path / f"co;touch {sentinel.name};x"
    for name in ("packline", "stages", "schemas", "pipelines", "configs"):
        shutil.copytree(PROJECT_ROOT / name, checkout / name)
    (checkout / "models").symlink_to(PROJECT_ROOT / "models")
    args = ["executor.slurm.account=acct", "executor.slurm.nproc_per_node=1", "model.path=null"]
    result = subprocess.run(
        [*PACKLINE, "run", f"work_dir={tmp_path / 'work'}", *args, "--executor", "slurm"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=checkout,  # python -m imports packline from the checkout
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"packline's checkout '{checkout}': ';' at character" in result.stderr
    assert not sentinel.exists() and not list(tmp_path.rglob("*.tar.gz"))


def test_the_log_listing_runs_a_hostile_dir_name_as_a_path(tmp_path: Path, monkeypatch):
    import nemo_run as run

    monkeypatch.chdir(tmp_path)  # where the shell would create the sentinel
    sentinel = tmp_path / "SENTINEL"
    job = tmp_path / "job dir;touch SENTINEL;$(touch SENTINEL);`touch SENTINEL`"
    job.mkdir()
    (job / "sbatch_x_1.out").write_text("log\n")
    result = run.LocalTunnel(job_dir=str(tmp_path)).run(
        listing_command(str(job)), hide=True, in_stream=False
    )
    assert result.stdout.split() == ["sbatch_x_1.out"]
    assert not sentinel.exists()


# --- never delete what packline did not create ------------------------------------------------


def _folder(root: Path) -> Path:
    from tests.integration.test_prepare import make_folder

    return make_folder(root)[0]


def _llava_file(root: Path) -> Path:
    folder = _folder(root)
    lines = (folder / "conversations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if not line.startswith("{this")]
    path = folder / "mix.json"
    path.write_text(json.dumps(records))
    return path


@pytest.mark.parametrize(
    "where, make",
    [
        ("prepare", _folder),
        ("connect", _llava_file),
        ("train", lambda root: write_chatml_dataset(root / "ds").root),
        ("source", _folder),
    ],
    ids=["folder", "llava", "energon", "source"],
)
def test_a_source_inside_a_stage_dir_is_refused_and_left_as_it_was(tmp_path, where, make):
    work = tmp_path / "work"
    source = make(work / where / "mine")
    before = _snapshot(work)
    result = _cli("stage", "prepare", f"work_dir={work}", f"data.source={source}", *SMALL)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"data.source '{source}' lies inside {work / where}" in result.stderr
    assert "fix: move it out of" in result.stderr and "Traceback" not in result.stderr
    assert _snapshot(work) == before


def test_a_llava_media_dir_inside_a_stage_dir_is_refused_and_left_as_it_was(tmp_path: Path):
    work = tmp_path / "work"
    llava = _llava_file(work / "validate")  # the records' media under <work>/validate/data
    media = llava.parent
    source = llava.rename(tmp_path / llava.name)
    before = _snapshot(work)
    result = _cli(
        "stage", "prepare", f"work_dir={work}", f"data.source={source}", f"data.media_dir={media}"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"data.media_dir '{media}' lies inside {work / 'validate'}" in result.stderr
    assert _snapshot(work) == before


def test_a_stage_dir_packline_did_not_make_is_refused_before_any_work(tmp_path: Path):
    work = tmp_path / "work"
    theirs = _folder(work / "prepare")  # the user's own folder, where prepare publishes
    before = _snapshot(work / "prepare")
    result = _cli("stage", "prepare", f"work_dir={work}", *SMALL)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{work / 'prepare'} exists and is not made by packline" in result.stderr
    assert "fix: move it away, or choose another work_dir" in result.stderr
    assert _snapshot(work / "prepare") == before and theirs.is_dir()
    assert not list(work.glob(".tmp-*"))


def test_publish_replaces_only_a_dir_packline_made(tmp_path: Path):
    final = tmp_path / "prepare"
    final.mkdir()
    (final / "mine.txt").write_text("keep me")
    tmp = tmp_path / ".tmp-prepare-1"
    tmp.mkdir()
    with pytest.raises(UserError, match="not made by packline"):
        publish(tmp, final)
    assert (final / "mine.txt").read_text() == "keep me" and not tmp.exists()
    (final / "mine.txt").unlink()
    final.rmdir()
    for n in (1, 2):  # made by packline, then replaced by packline
        tmp = tmp_path / f".tmp-prepare-{n}"
        tmp.mkdir()
        (tmp / "n").write_text(str(n))
        publish(tmp, final)
        assert is_owned(final) and (final / "n").read_text() == str(n)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepare"]


# --- one writer per work dir ---------------------------------------------------------------


def test_a_second_invocation_is_refused_naming_the_holder(tmp_path: Path):
    work = tmp_path / "work"
    with hold(work, command="packline run (held by the test)"):
        result = _cli("stage", "prepare", f"work_dir={work}", *SMALL)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{work} is in use by pid {os.getpid()}" in result.stderr
    assert "`packline run (held by the test)`" in result.stderr
    assert "add --wait" in result.stderr and "Traceback" not in result.stderr
    assert not (work / "prepare").exists()


def test_two_prepares_at_once_give_one_success_and_one_refusal(tmp_path: Path):
    work = tmp_path / "work"
    first = _popen(
        "stage", "prepare", f"work_dir={work}", "data.num_train=1500", log=tmp_path / "a.log"
    )
    _wait_for(lambda: holder(work).get("pid") == first.pid, what="the first to hold the lock")
    # the first is stopped mid-run (its whole process group), so the second surely meets it
    # at work however slowly this machine starts the second; then it runs on
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = _cli("stage", "prepare", f"work_dir={work}", "data.num_train=1500")
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert first.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-2000:]
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"is in use by pid {first.pid}" in second.stderr
    third = _cli("stage", "prepare", f"work_dir={work}", "data.num_train=1500")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "prepare: up to date" in third.stdout + third.stderr
    record = json.loads((work / "prepare" / "_COMPLETE.json").read_text())
    assert record["metrics"]["prepare/rows_rejected"] == 0
    assert record["metrics"]["prepare/rows_accepted"] == 1700


def test_wait_waits_for_the_holder_then_runs(tmp_path: Path):
    work = tmp_path / "work"
    log = tmp_path / "wait.log"
    with hold(work, command="the test"):
        waiter = _popen("stage", "prepare", f"work_dir={work}", *SMALL, "--wait", log=log)
        _wait_for(lambda: "waiting for" in log.read_text(), what="the waiting message")
        assert waiter.poll() is None  # still waiting
    assert waiter.wait(timeout=600) == 0, log.read_text()[-2000:]
    assert (work / "prepare" / "_COMPLETE.json").is_file()
    assert holder(work)["released"] is True


def test_a_killed_holders_lock_is_taken_over_and_its_temp_dirs_removed(tmp_path: Path):
    work = tmp_path / "work"
    killed = _popen(
        "stage", "prepare", f"work_dir={work}", "data.num_train=1500", log=tmp_path / "a.log"
    )
    _wait_for(lambda: list(work.glob("source/.tmp-*")), what="the built-in set being generated")
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert list(work.glob("source/.tmp-*"))
    result = _cli("stage", "prepare", f"work_dir={work}", "data.num_train=1500")
    assert result.returncode == 0, result.stderr[-2000:]
    out = " ".join((result.stdout + result.stderr).split())
    assert f"taking over the lock of {work} left by pid {killed.pid}" in out
    assert "ended without releasing it" in out
    assert not list(work.glob("**/.tmp-*")) and not list(work.glob("**/.old-*"))
    record = json.loads((work / "prepare" / "_COMPLETE.json").read_text())
    assert record["metrics"]["prepare/rows_rejected"] == 0
    assert (work / LOCK_NAME).is_file()


def test_a_partial_builtin_set_is_found_and_generated_again(tmp_path: Path):
    work = tmp_path / "work"
    assert _cli("stage", "prepare", f"work_dir={work}", *SMALL).returncode == 0
    (source,) = (work / "source").iterdir()
    victim = sorted((source / "images").iterdir())[3]
    victim.unlink()  # what a raced or killed generation left, marked complete
    result = _cli("stage", "prepare", f"work_dir={work}", *SMALL, "--force")
    assert result.returncode == 0, result.stderr[-2000:]
    out = " ".join((result.stdout + result.stderr).split())
    assert "is incomplete" in out and "regenerating" in out
    assert victim.is_file()
    record = json.loads((work / "prepare" / "_COMPLETE.json").read_text())
    assert record["metrics"]["prepare/rows_rejected"] == 0


# --- a killed stage leaves no process behind -------------------------------------------------


def _session(leader: int) -> list[psutil.Process]:
    """The live processes of the session ``leader`` started (zombies are ended)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == leader and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


@pytest.mark.parametrize("stage", ["prepare", "connect"])
def test_sigkill_of_a_stage_leaves_no_worker_alive_10s_later(tmp_path: Path, stage: str):
    work = tmp_path / "work"
    data = ["data.num_train=1500", "data.num_val=100"]
    if stage == "connect":
        assert _cli("stage", "prepare", f"work_dir={work}", *data).returncode == 0
    log = tmp_path / f"{stage}.log"
    parent = _popen("stage", stage, f"work_dir={work}", *data, f"{stage}.num_workers=2", log=log)
    # the parent and its 2 workers at work (prepare's pool: a fork server and the pool's
    # resource tracker besides)
    least = 5 if stage == "prepare" else 3
    _wait_for(
        lambda: len(_session(parent.pid)) >= least and parent.poll() is None,
        what=f"{stage}'s workers",
    )
    workers = [p for p in _session(parent.pid) if p.pid != parent.pid]
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=60)
    time.sleep(10)
    left = [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], [p.cmdline() for p in left]
    # and the next run removes the dead run's temp dirs
    assert _cli("stage", stage, f"work_dir={work}", *data).returncode == 0
    assert not list(work.glob("**/.tmp-*"))


# --- a failed stage stops the chain ----------------------------------------------------------


def test_run_stops_at_a_failed_stage_and_shows_the_rest_skipped(tmp_path: Path):
    source = tmp_path / "bad"
    source.mkdir()
    (source / "conversations.jsonl").write_text('not json\n{"id": "a"}\n')
    work = tmp_path / "work"
    result = _cli("run", f"work_dir={work}", f"data.source={source}", "prepare.num_workers=1")
    assert result.returncode == 2, result.stderr[-3000:]
    out = result.stdout + result.stderr
    lines = [line.strip("│ ") for line in out.splitlines()]
    top = next(i for i, line in enumerate(lines) if line.startswith("prepare failed: "))
    assert "prepare: no usable rows" in lines[top]
    table = [line for line in lines[top + 1 :] if line.split(" ", 1)[0] in ("prepare", "connect")]
    assert "FAILED" in table[0]
    for stage in ("connect", "validate", "train"):
        row = next(line for line in lines[top:] if line.startswith(stage + " "))
        assert "SKIPPED" in row and "not started: prepare failed" in row
    assert "✗ prepare   failed" in out and "connect" not in " ".join(
        p.name for p in (work / "nemorun" / "experiments").rglob("*")
    )
    assert not (work / "connect").exists() and not (work / "validate").exists()
    assert out.rstrip().endswith("reasons: {'malformed_json': 1, 'malformed': 1}")
