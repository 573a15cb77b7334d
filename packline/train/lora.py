"""PEFT's LoRA wrap, as packline calls it (one home for the one-process and the
expert-parallel model)."""

from __future__ import annotations

import warnings

from peft import LoraConfig, get_peft_model


def peft_wrap(model, config: LoraConfig):
    """PEFT's ``get_peft_model``, without the FutureWarning PEFT's constructor triggers by
    reading transformers' deprecated ``is_gradient_checkpointing`` (peft 0.21 on
    transformers 5.24: a skew between the two, nothing packline can act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        return get_peft_model(model, config)
