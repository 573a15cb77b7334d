"""``train.loss: sample``: each conversation's mean token loss, averaged over the
conversations, the same packed and unpacked, and the mean of each conversation run alone
(the tiny Qwen3-VL, thd attention, fp32). Across ranks and layouts (DP, EP, PP) the trainer's
step is checked in tests/integration/test_train_ddp.py."""

from __future__ import annotations

import pytest
import torch

from packline.packing.thd import EncodedConversation, build_packed_batch, build_padded_batch
from packline.qwen.attention import set_text_attention
from packline.qwen.forward import (
    conversation_weights,
    packed_loss,
    padded_forward,
    padded_loss,
    token_loss_sum,
)
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor, load_processor
from schemas.config import load_config
from schemas.errors import UserError

#: (tokens, first target position): targets are the tail; the last holds no target at all
SHAPES = [(7, 3), (5, 1), (19, 4), (11, 11)]


def _conversations() -> list[EncodedConversation]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (n, first) in enumerate(SHAPES):
        target = torch.zeros(n, dtype=torch.bool)
        target[first:] = True
        out.append(
            EncodedConversation(
                key=f"c{i}",
                input_ids=torch.randint(10, 200, (n,), generator=gen),
                target_mask=target,
                mrope=torch.arange(n).expand(3, n),
            )
        )
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("proc")
    copy_tiny_processor(path)
    return set_text_attention(build_tiny_model(load_processor(path), seed=1), "thd")


def _grads(model) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads.double()


def test_sample_loss_is_the_mean_of_each_conversation_alone_packed_and_unpacked(model):
    convs = _conversations()
    with torch.no_grad():  # the reference: each conversation alone, its mean token loss
        means = []
        for c in convs:
            alone = build_padded_batch([c])
            total, targets = token_loss_sum(
                padded_forward(model, alone, image_token_id=-1), alone.labels
            )
            if targets:
                means.append(float(total) / targets)
    reference = sum(means) / len(means)
    assert len(means) == 3  # the conversation without a target is not counted

    row = build_packed_batch(convs, seq_length=64, alignment=4)
    padded = build_padded_batch(convs)
    weights, conversations = conversation_weights(row)
    assert conversations == conversation_weights(padded)[1] == 3
    assert float(weights.sum()) == pytest.approx(3.0, abs=1e-12)  # each conversation weighs 1

    packed_sum, _, _ = packed_loss(model, row, image_token_id=-1, per_sample=True)
    (packed_sum / conversations).backward()
    packed_grads = _grads(model)
    padded_sum, _, _ = padded_loss(model, padded, image_token_id=-1, per_sample=True)
    (padded_sum / conversations).backward()
    padded_grads = _grads(model)
    assert float(packed_sum.detach()) / conversations == pytest.approx(reference, abs=1e-6)
    assert float(padded_sum.detach()) / conversations == pytest.approx(reference, abs=1e-6)
    scale = float(packed_grads.abs().max())
    assert float((packed_grads - padded_grads).abs().max()) <= 1e-5 * scale

    # the token loss weighs the long conversation more: another figure on the same rows
    with torch.no_grad():
        token_sum, targets, _ = packed_loss(model, row, image_token_id=-1)
    assert float(token_sum) / targets != pytest.approx(reference, abs=1e-3)


def test_the_chunked_loss_weighs_each_chunk_as_the_whole(model):
    """The LM head runs chunk by chunk; the weights are cut with the labels."""
    row = build_packed_batch(_conversations(), seq_length=64, alignment=4)
    with torch.no_grad():
        whole, _, _ = packed_loss(model, row, image_token_id=-1, per_sample=True)
        chunked, _, _ = packed_loss(model, row, image_token_id=-1, per_sample=True, chunk_tokens=5)
    assert float(chunked) == pytest.approx(float(whole), rel=1e-12)


def test_megatron_refuses_the_sample_loss_with_the_reason():
    with pytest.raises(UserError) as info:
        load_config(None, ["train.backend=megatron", "train.loss=sample"])
    text = "\n".join(info.value.problems)
    assert "train.loss is sample with train.backend megatron" in text
    assert "create_masked_next_token_loss_function" in text and "train.loss=token" in text
    assert load_config(None, ["train.loss=sample"]).train.loss.value == "sample"
