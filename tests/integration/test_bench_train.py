"""``packline bench train`` as a user runs it: a subprocess on a small config of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packline import metrics as names
from packline.shapes.generate import ANSWER_CHOICES
from packline.train.records import read_records
from tests.integration.bench_cli import run_bench

SMALL_YAML = """\
name: bench_small
data: {num_train: 120, num_val: 8}
prepare: {num_workers: 1}
train: {max_steps: 2, global_batch_size: 2, eval_samples: 2}
"""


@pytest.mark.slow
def test_bench_train_cli_measures_both_runs_on_the_same_conversations(tmp_path: Path):
    """Both runs in turns, a window of one step each, a CPU-bound neighbour beside the
    second window (--noise): every figure per wall-clock and per CPU-second, per window."""
    result, _, work = run_bench("train", SMALL_YAML, tmp_path, "--noise", "--window", "1")
    rate = result["real_tokens_per_s"]
    assert rate["packed"] > 0 and rate["unpacked"] > 0
    assert result["speedup"] == pytest.approx(rate["packed"] / rate["unpacked"])
    # per CPU-second: the process's CPU time over all its threads, beside the wall clock
    cpu, per_cpu = result["cpu_seconds"], result["real_tokens_per_cpu_s"]
    for run in ("packed", "unpacked"):
        assert per_cpu[run] == pytest.approx(result["real_tokens"][run] / cpu[run])
    assert result["speedup_per_cpu_s"] == pytest.approx(per_cpu["packed"] / per_cpu["unpacked"])
    # two windows of one step, the neighbour beside the second; a ratio per window
    assert result["window_steps"] == 1 and result["noisy_from_window"] == 1
    windows = result["window_tokens_per_s"]
    assert len(windows["packed"]) == len(windows["unpacked"]) == 2
    assert result["window_speedups"] == pytest.approx(
        [a / b for a, b in zip(windows["packed"], windows["unpacked"], strict=True)]
    )
    noise = result["noise"]
    assert noise["quiet_wall"] == pytest.approx(result["window_speedups"][0])
    assert noise["noisy_wall"] == pytest.approx(result["window_speedups"][1])
    assert noise["noisy_over_quiet_wall"] == pytest.approx(
        noise["noisy_wall"] / noise["quiet_wall"]
    )
    assert noise["noisy_over_quiet_cpu"] == pytest.approx(noise["noisy_cpu"] / noise["quiet_cpu"])
    # the same conversations per step: equal real tokens, loss and accuracy; only padding differs
    assert result["real_tokens"]["packed"] == result["real_tokens"]["unpacked"] > 0
    assert result["padded_tokens"]["packed"] == 0 < result["padded_tokens"]["unpacked"]
    assert result["eval_loss"]["packed"] == pytest.approx(result["eval_loss"]["unpacked"], abs=1e-6)
    assert result["eval_questions"] == {"packed": 2, "unpacked": 2}
    for run in ("packed", "unpacked"):  # the same questions, split by kind, with their chance
        by_kind = result["eval_by_kind"][run]
        assert sum(k["questions"] for k in by_kind.values()) == 2
        # None only for a kind with no closed answer set whose questions were all answered
        # alike (evaluate.guess_chance: no chance to tell)
        for kind, k in by_kind.items():
            assert (k["chance"] is None and kind not in ANSWER_CHOICES) or 0 < k["chance"] <= 1
    # both reach the higher of the two final eval losses, by their last evaluation at latest
    reach = result["seconds_to_eval_loss"]
    assert result["target_eval_loss"] == max(result["eval_loss"].values())
    assert 0 <= reach["packed"] <= result["train_seconds"]["packed"] + 1e-9
    assert 0 <= reach["unpacked"] <= result["train_seconds"]["unpacked"] + 1e-9
    assert result["seconds_to_eval_loss_ratio"] == pytest.approx(
        reach["unpacked"] / reach["packed"]
    )
    assert result["targets"]["equal_accuracy"]["held"]
    assert set(result["targets"]) == {"speedup", "equal_accuracy", "noise"}
    assert result["targets"]["noise"]["value"] == noise["noisy_over_quiet_wall"]
    for run in ("packed", "unpacked"):  # each run's own records, from scratch
        steps = [json.loads(line) for line in (work / "bench-train" / run / "metrics.jsonl").open()]
        assert [s["step"] for s in steps] == [1, 2]
    # both start from the same weights: the packed run's start evaluation serves both
    runs = ("packed", "unpacked")
    starts = {run: read_records(work / "bench-train" / run / "eval.jsonl")[0] for run in runs}
    assert names.EVAL_EVALUATED_IN not in starts["packed"]
    assert starts["unpacked"][names.EVAL_EVALUATED_IN] == "packed"
    # where the time went: data and vision are parts of each run's training seconds
    for run in ("packed", "unpacked"):
        data, vision = result["data_seconds"][run], result["vision_seconds"][run]
        assert data > 0 and vision > 0
        assert result["other_seconds"][run] == pytest.approx(
            result["train_seconds"][run] - data - vision
        )
        assert result["other_seconds"][run] > 0
    seconds, data = result["train_seconds"], result["data_seconds"]
    assert result["speedup_without_data"] == pytest.approx(
        (seconds["unpacked"] - data["unpacked"]) / (seconds["packed"] - data["packed"])
    )
    rest = result["other_seconds"]
    assert result["speedup_without_data_and_vision"] == pytest.approx(
        rest["unpacked"] / rest["packed"]
    )
    flops = result["tflops_executed"]
    assert flops["unpacked"] > flops["packed"] > 0  # padding is executed too
    assert result["flops_executed_ratio"] == pytest.approx(flops["unpacked"] / flops["packed"])
