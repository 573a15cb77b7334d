"""The packed forward checks its boundaries: row 0 of ``position_ids`` must restart exactly
at the row's ``cu_seqlens_padded`` offsets (and count up by 1 everywhere else), or the model
would find other conversations than the row holds — silently."""

from __future__ import annotations

import pytest
import torch

from packline.packing.thd import (
    EncodedConversation,
    build_packed_batch,
    check_text_positions,
    expected_text_positions,
)
from packline.qwen.forward import check_packed_inputs, packed_forward
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor, load_processor

LENGTHS = [7, 5, 9]


def _conversations(lengths=LENGTHS) -> list[EncodedConversation]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(lengths):
        target = torch.zeros(n, dtype=torch.bool)
        target[n // 2 :] = True
        out.append(
            EncodedConversation(
                key=f"c{i}",
                input_ids=torch.randint(10, 200, (n,), generator=gen),
                target_mask=target,
                mrope=torch.arange(n).expand(3, n),
            )
        )
    return out


def _row(**kwargs):
    return build_packed_batch(_conversations(), seq_length=48, **kwargs)


def _check(batch, text_positions=None) -> None:
    text = batch.position_ids[0] if text_positions is None else text_positions
    check_text_positions(text, batch.cu_seqlens_padded)


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"alignment": 4},
        {"pad_to_max_length": True},
        {"alignment": 8, "pad_to_max_length": True},
    ],
    ids=["plain", "alignment4", "pad_to_max_length", "alignment8_pad_to_max_length"],
)
def test_rows_built_by_build_packed_batch_pass(layout):
    batch = _row(**layout)
    _check(batch)
    check_packed_inputs(
        position_ids=batch.position_ids,
        cu_seqlens_padded=batch.cu_seqlens_padded,
        attention_mask=None,
        use_cache=False,
    )
    expected = expected_text_positions(batch.cu_seqlens_padded, batch.input_ids.shape[1])
    assert torch.equal(batch.position_ids[0, 0], expected)


def test_expected_positions_cover_gaps_and_the_tail():
    """Alignment gaps and the pad_to_max_length tail continue their segment's count."""
    batch = _row(alignment=4, pad_to_max_length=True)
    assert batch.cu_seqlens.tolist() == [0, 7, 12, 21]
    assert batch.cu_seqlens_padded.tolist() == [0, 8, 16, 48]
    text = batch.position_ids[0, 0].tolist()
    assert text[:8] == list(range(8)) and text[8:16] == list(range(8))
    assert text[16:] == list(range(32))


def _edited(batch, start: int, values: list[int]) -> torch.Tensor:
    text = batch.position_ids[0].clone()
    text[0, start : start + len(values)] = torch.tensor(values)
    return text


@pytest.mark.parametrize("layout", [{}, {"alignment": 4, "pad_to_max_length": True}])
def test_a_restart_moved_one_token_later_raises(layout):
    batch = _row(**layout)
    b = int(batch.cu_seqlens_padded[1])
    end = int(batch.cu_seqlens_padded[2])
    text = _edited(batch, b, [b, *range(end - b - 1)])  # first continues, restart at b + 1
    with pytest.raises(ValueError, match=f"first mismatch at offset {b}: a conversation starts"):
        _check(batch, text)


def test_a_restart_moved_one_token_earlier_raises():
    batch = _row()
    b = int(batch.cu_seqlens_padded[1])
    end = int(batch.cu_seqlens_padded[2])
    text = _edited(batch, b - 1, list(range(end - b + 1)))  # second starts at b - 1
    with pytest.raises(
        ValueError, match=f"first mismatch at offset {b - 1}: the positions restart"
    ):
        _check(batch, text)


def test_a_missing_restart_raises():
    """The second conversation continues the first: the model would see one conversation."""
    batch = _row(alignment=4)
    b = int(batch.cu_seqlens_padded[2])
    end = int(batch.cu_seqlens_padded[3])
    text = _edited(batch, b, list(range(b - 8, b - 8 + end - b)))
    with pytest.raises(ValueError, match=f"first mismatch at offset {b}: a conversation starts"):
        _check(batch, text)


def test_an_extra_restart_raises():
    """A restart inside a conversation would cut it in two."""
    batch = _row(pad_to_max_length=True)
    start = int(batch.cu_seqlens_padded[2])
    text = _edited(batch, start + 3, list(range(48 - start - 3)))
    with pytest.raises(ValueError, match=f"first mismatch at offset {start + 3}: the positions"):
        _check(batch, text)


def test_positions_that_jump_without_restarting_at_zero_raise():
    """HF finds a new conversation wherever +1 breaks, not only at 0."""
    batch = _row()
    text = _edited(batch, 2, [5, 6, 7, 8, 9])
    with pytest.raises(ValueError, match="first mismatch at offset 2: the positions restart"):
        _check(batch, text)


def test_boundaries_that_do_not_describe_the_row_raise():
    batch = _row(alignment=4)
    with pytest.raises(ValueError, match="does not describe a row of 28 tokens"):
        check_text_positions(batch.position_ids[0], batch.cu_seqlens_padded[:-1])
    with pytest.raises(ValueError, match="does not describe a row of 28 tokens"):
        check_text_positions(batch.position_ids[0], torch.tensor([0, 16, 8, 28]))


def test_an_empty_row_passes():
    batch = build_packed_batch([], seq_length=16)
    _check(batch)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("proc")
    copy_tiny_processor(path)
    return build_tiny_model(load_processor(path), seed=1)


def test_packed_forward_refuses_positions_that_disagree_with_cu_seqlens(model):
    """The check runs on every packed forward, before the model (and its attention, which
    finds conversations from the positions) sees the row."""
    batch = _row(alignment=4)
    with torch.no_grad():
        logits = packed_forward(model, batch, image_token_id=-1)
    assert logits.shape[:2] == (1, 28)
    b = int(batch.cu_seqlens_padded[1])
    moved = batch.position_ids.clone()
    moved[0, 0, b : b + 2] = torch.tensor([b, 0])
    with pytest.raises(ValueError, match=f"unsafe packed forward: .*offset {b}"):
        packed_forward(model, batch, image_token_id=-1, position_ids=moved)
