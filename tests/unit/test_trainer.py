"""Small pieces of the trainer: precision, the learning-rate schedule, the LoRA wrap, the
shared start evaluation."""

from __future__ import annotations

import warnings

import pytest
import torch

from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor, load_processor
from packline.train.evaluate import EvalMemo, EvalResult, weights_digest
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


def test_runs_seeded_alike_share_their_start_evaluation_and_nothing_else(tmp_path):
    """Packing on and off build the model and its adapters from the same seed: the same
    weights, bit for bit, so the run that starts second reads the first one's step-0
    evaluation from the memo. Other weights (one optimizer step) or another key (the stage's
    inputs changed) find nothing and evaluate afresh."""
    copy_tiny_processor(tmp_path)
    processor = load_processor(tmp_path)

    def seeded():
        torch.manual_seed(0)
        return apply_lora(build_tiny_model(processor, seed=0), LoraConfig())

    packed, unpacked = seeded(), seeded()
    start = weights_digest(packed)
    assert weights_digest(unpacked) == start
    result = EvalResult(
        loss=2.7, token_accuracy=0.55, accuracy=0.08, questions=1,
        by_kind={"count": {"questions": 1, "accuracy": 0.0}},
        answers=[{"key": "k", "kind": "count", "question": "How many?", "expected": "3",
                  "reply": "2", "right": False}],
    )  # fmt: skip
    memo = EvalMemo(tmp_path / "start_eval.json", key="fp-1")
    assert memo.get(start) is None
    memo.put(start, result, "packed")
    assert memo.get(start) == (result, "packed")

    trained = [p for p in unpacked.parameters() if p.requires_grad]
    with torch.no_grad():
        trained[-1].add_(1e-3)  # what an optimizer step does to the adapters
    assert memo.get(weights_digest(unpacked)) is None
    assert EvalMemo(memo.path, key="fp-2").get(start) is None
