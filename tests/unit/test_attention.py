"""``packline_thd`` attention: per-conversation work on packed rows, HF sdpa everywhere else.

The packed-row logits themselves are checked against solo runs in
``tests/integration/test_packing_invisible.py`` (thd is one of its attention variants).
"""

from __future__ import annotations

import pytest
import torch

import packline.qwen.attention as attention
from packline.qwen.attention import THD_ATTENTION, conversation_bounds, set_text_attention
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor, load_processor


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    path = tmp_path_factory.mktemp("proc")
    copy_tiny_processor(path)
    return load_processor(path)


def _model(processor, attn: str):
    return set_text_attention(build_tiny_model(processor, seed=1), attn)


@pytest.mark.parametrize(
    ("positions", "bounds"),
    [
        ([0, 1, 2, 3], [(0, 4)]),
        ([0, 1, 0, 1, 2], [(0, 2), (2, 5)]),
        ([0, 0, 0], [(0, 1), (1, 2), (2, 3)]),
        ([5, 6, 7, 0, 1], [(0, 3), (3, 5)]),  # starts where +1 breaks, like HF's detection
        ([], []),
    ],
)
def test_conversation_bounds(positions, bounds):
    assert conversation_bounds(torch.tensor([positions], dtype=torch.long)) == bounds


def test_packed_row_runs_one_attention_per_conversation(processor, monkeypatch):
    """Each layer attends once per conversation, over that conversation only."""
    seen: list[int] = []
    real = attention.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    model = _model(processor, "thd")
    ids = torch.randint(10, 200, (1, 12))
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]).view(1, 1, -1).expand(4, 1, -1)
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
    layers = model.config.text_config.num_hidden_layers
    assert seen == [5, 3, 4] * layers


def test_conversations_are_found_once_per_forward_and_never_reused_stale(processor, monkeypatch):
    """One search of the positions per forward, shared by the layers; a new forward (new
    positions tensor) or an in-place change to the positions searches again."""
    calls: list[list[tuple[int, int]]] = []
    real = attention.conversation_bounds

    def spy(positions):
        calls.append(real(positions))
        return calls[-1]

    monkeypatch.setattr(attention, "conversation_bounds", spy)
    model = _model(processor, "thd")
    assert model.config.text_config.num_hidden_layers > 1
    ids = torch.randint(10, 200, (1, 6))

    def forward(positions):
        with torch.no_grad():
            return model(input_ids=ids, position_ids=positions, use_cache=False).logits

    a = torch.tensor([0, 1, 2, 0, 1, 2]).view(1, 1, -1).expand(4, 1, -1)
    b = torch.tensor([0, 1, 2, 3, 4, 5]).view(1, 1, -1).expand(4, 1, -1)
    forward(a)
    forward(b)
    assert calls == [[(0, 3), (3, 6)], [(0, 6)]]
    text = torch.tensor([[0, 1, 0, 1, 2, 3]])
    assert attention._bounds_of(text) == [(0, 2), (2, 6)]
    assert attention._bounds_of(text) == [(0, 2), (2, 6)] and len(calls) == 3  # reused
    text[0, 4:] = torch.tensor([0, 1])  # in place: a new version
    assert attention._bounds_of(text) == [(0, 2), (2, 4), (4, 6)] and len(calls) == 4


def test_padded_batches_and_generation_match_sdpa(processor):
    """A padding mask or a KV cache goes to HF's sdpa unchanged: same logits, same tokens."""
    thd, sdpa = _model(processor, "thd"), _model(processor, "sdpa")
    assert thd.config.text_config._attn_implementation == THD_ATTENTION
    assert thd.config.vision_config._attn_implementation == "sdpa"
    ids = torch.randint(10, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        a = thd(input_ids=ids, attention_mask=mask, use_cache=False).logits
        b = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(a[mask.bool()], b[mask.bool()])
        gen = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        assert torch.equal(thd.generate(ids[:1], **gen), sdpa.generate(ids[:1], **gen))


def test_unknown_attention_is_refused(processor):
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        _model(processor, "flash")


def test_docstring_has_a_worked_example():  # pytest --doctest-modules runs it
    import doctest

    assert any(test.examples for test in doctest.DocTestFinder().find(attention))
