"""``packline bench train`` as a user runs it: a subprocess on a small config of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from packline.shapes.generate import ANSWER_CHOICES
from tests.integration.bench_cli import run_bench

SMALL_YAML = """\
name: bench_small
data: {num_train: 120, num_val: 8}
prepare: {num_workers: 1}
train: {max_steps: 2, global_batch_size: 2, eval_samples: 2}
"""


@pytest.mark.slow
def test_bench_train_cli_measures_both_runs_on_the_same_conversations(tmp_path: Path):
    result, _, work = run_bench("train", SMALL_YAML, tmp_path)
    rate = result["real_tokens_per_s"]
    assert rate["packed"] > 0 and rate["unpacked"] > 0
    assert result["speedup"] == pytest.approx(rate["packed"] / rate["unpacked"])
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
    assert set(result["targets"]) == {"speedup", "equal_accuracy"}
    assert (work / "train" / "packed" / "eval.jsonl").is_file()
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
