"""Progress where stderr is not a terminal (a SLURM job's log): plain lines, throttled."""

from __future__ import annotations

from packline.progress import progress


def test_a_log_gets_a_plain_line_per_interval_and_one_when_a_task_ends(capsys) -> None:
    with progress(log_every=0.0) as bar:  # every update is due
        task = bar.add_task("pretraining: loss 2.000", total=4)
        for step in range(4):
            bar.update(task, advance=1, description=f"pretraining: loss {2 - step / 2:.3f}")
        bar.update(task, description="pretraining: loss 0.500")  # after the end: no new line
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "elapsed" in ln]
    assert [ln.split("  elapsed")[0] for ln in lines] == [
        "pretraining: loss 2.000  1/4 (25%)",
        "pretraining: loss 1.500  2/4 (50%)",
        "pretraining: loss 1.000  3/4 (75%)",
        "pretraining: loss 0.500  4/4 (100%)",
    ]
    assert "remaining" not in lines[-1]  # the finished line gives no estimate


def test_lines_are_throttled_to_the_interval(capsys) -> None:
    with progress(log_every=3600.0) as bar:
        task = bar.add_task("connect", total=1000)
        for _ in range(1000):
            bar.advance(task)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "elapsed" in ln]
    # the first update is due at once, then none for an hour, then the end
    assert [ln.split("  elapsed")[0] for ln in lines] == [
        "connect  1/1,000 (0%)",
        "connect  1,000/1,000 (100%)",
    ]


def test_disabled_progress_writes_nothing(capsys) -> None:
    with progress(disable=True, log_every=0.0) as bar:
        task = bar.add_task("rank 1", total=2)
        bar.advance(task, 2)
    assert capsys.readouterr().err == ""
