"""Small pieces of the trainer: precision, the learning-rate schedule, the LoRA wrap."""

from __future__ import annotations

import warnings

import pytest
import torch

from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor, load_processor
from packline.train.setup import apply_lora
from packline.train.trainer import lr_lambda, use_bf16
from schemas.config import LoraConfig


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


def test_lora_wraps_the_model_without_a_warning(tmp_path):
    """PEFT's wrap reads transformers' deprecated ``is_gradient_checkpointing``: every run
    printed its FutureWarning, which nothing in packline can act on. It is silenced there
    and only there: warnings from anything else still show."""
    copy_tiny_processor(tmp_path)
    model = build_tiny_model(load_processor(tmp_path), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = apply_lora(model, LoraConfig())  # the schema's default targets
        _ = model.is_gradient_checkpointing  # the same property, outside the wrap: it warns
    assert any(p.requires_grad for p in wrapped.parameters())
    assert [str(w.message)[:40] for w in caught] == ["`is_gradient_checkpointing` is deprecate"]
