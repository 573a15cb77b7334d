"""Small pieces of the trainer: precision and the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch

from packline.train.trainer import lr_lambda, use_bf16


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
