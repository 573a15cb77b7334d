"""THD rows (packline.packing.thd): padded boundaries on the alignment, labels that never
cross a conversation."""

from __future__ import annotations

import doctest

import pytest
import torch

import packline.packing.thd as thd
from packline.packing.thd import EncodedConversation, build_packed_batch
from schemas.config import load_config
from schemas.errors import UserError


def test_docstrings_have_worked_examples():  # pytest --doctest-modules runs them
    assert any(test.examples for test in doctest.DocTestFinder().find(thd))


def _conv(key: str, n: int) -> EncodedConversation:
    ids = torch.arange(1, n + 1)
    return EncodedConversation(
        key=key,
        input_ids=ids,
        target_mask=ids % 2 == 0,
        mrope=torch.arange(n).expand(3, n),
    )


ALIGN_CASES = [  # (TP, CP, SP, m)
    (1, 1, False, 1),
    (8, 1, False, 1),
    (1, 2, False, 4),
    (2, 1, True, 2),
    (4, 2, True, 8),
    (2, 4, True, 8),
    (4, 3, True, 12),
]


@pytest.mark.parametrize(("tp", "cp", "sp", "m"), ALIGN_CASES)
def test_padded_boundaries_are_multiples_of_the_alignment(tp, cp, sp, m):
    cfg = load_config(
        None,
        [
            f"packing.tensor_parallel={tp}",
            f"packing.context_parallel={cp}",
            f"packing.sequence_parallel={sp}",
            "packing.seq_length=2400",
        ],
    )
    assert cfg.packing.alignment == m
    convs = [_conv(f"c{i}", n) for i, n in enumerate([5, 17, 1, 33, 64, 7])]
    batch = build_packed_batch(convs, seq_length=2400, alignment=m)
    assert all(b % m == 0 for b in batch.cu_seqlens_padded.tolist())
    assert batch.seq_lens == [5, 17, 1, 33, 64, 7]
    fixed = build_packed_batch(convs, seq_length=2400, alignment=m, pad_to_max_length=True)
    assert fixed.input_ids.shape == (1, 2400) and fixed.cu_seqlens_padded[-1] == 2400


def test_seq_length_not_divisible_by_the_alignment_is_rejected():
    with pytest.raises(UserError) as info:
        load_config(
            None,
            [
                "packing.tensor_parallel=4",
                "packing.context_parallel=2",
                "packing.sequence_parallel=true",
                "packing.seq_length=2044",
            ],
        )
    assert info.value.problems == [
        "packing.seq_length 2044 is not a multiple of the alignment m = lcm(2·CP, CP·TP) = 8 "
        "(TP 4, CP 2, SP True); use 2048 or 2040"
    ]


def test_labels_never_cross_a_conversation_boundary():
    a, b = _conv("a", 6), _conv("b", 5)
    batch = build_packed_batch([a, b], seq_length=16, alignment=4)
    labels = batch.labels[0].tolist()
    # a occupies 0..5 (+2 gap), b 8..12 (+3 gap); last token of each and gaps are -100
    assert labels[5] == labels[6] == labels[7] == -100
    assert labels[12:] == [-100] * 4
    # targets are the even ids (target_mask = id % 2 == 0), shifted left by one
    assert labels[:5] == [2, -100, 4, -100, 6]
    assert batch.num_loss_tokens == sum(x != -100 for x in labels)
    with pytest.raises(ValueError, match="do not fit seq_length 12"):
        build_packed_batch([a, b], seq_length=12, alignment=4)
