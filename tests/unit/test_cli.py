"""The CLI's command line: overrides before or after options, stray options refused."""

from __future__ import annotations

import pytest

from pipelines.cli import parse_args


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "configs/tiny_cpu.yaml", "a=1", "--executor", "slurm", "b=2"],
        ["run", "--executor", "slurm", "configs/tiny_cpu.yaml", "a=1", "b=2"],
        ["run", "configs/tiny_cpu.yaml", "--executor", "slurm", "a=1", "b=2"],
    ],
)
def test_overrides_may_follow_options_and_keep_their_order(argv):
    ns = parse_args(argv)
    assert ns.args == ["configs/tiny_cpu.yaml", "a=1", "b=2"]
    assert ns.executor == "slurm"


def test_stage_overrides_after_force():
    ns = parse_args(["stage", "train", "configs/tiny_cpu.yaml", "--force", "train.max_steps=2"])
    assert (ns.name, ns.force, ns.args) == (
        "train",
        True,
        ["configs/tiny_cpu.yaml", "train.max_steps=2"],
    )


def test_unknown_option_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["run", "a=1", "--frobnicate", "b=2"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --frobnicate b=2" in capsys.readouterr().err


def test_a_bench_option_another_benchmark_reads_is_refused(capsys):
    from pipelines.cli import main

    assert main(["bench", "packing", "--samples", "100"]) == 2
    err = capsys.readouterr().err
    assert "--samples applies to bench data only, not bench packing" in err
    assert main(["bench", "train", "--bridge-path", "/x"]) == 2
    assert "--bridge-path applies to bench cluster-memory only" in capsys.readouterr().err
