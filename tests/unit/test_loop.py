"""Small pieces of the train loop and its benchmark, and their docstring examples."""

from __future__ import annotations

import doctest

import pytest
import torch

from packline.train import loop
from packline.train.loop import lr_lambda, use_bf16
from pipelines import bench_train


@pytest.mark.parametrize("module", [loop, bench_train])
def test_docstring_examples_hold(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_precision_on_a_cpu():
    cpu = torch.device("cpu")
    assert [use_bf16(p, cpu) for p in ("auto", "bf16", "fp32")] == [False, True, False]
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        use_bf16("fp16", cpu)


def test_lr_warms_up_then_decays_to_zero():
    rates = [lr_lambda(s, warmup=5, total=40) for s in range(41)]
    assert rates[0] == 0.2 and rates[0] < rates[3] < rates[4] == rates[5] == 1.0  # 5 warmup
    assert all(a >= b for a, b in zip(rates[5:], rates[6:], strict=False))
    assert rates[40] == pytest.approx(0.0, abs=1e-12)
