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


# --- the choice per device, and the varlen kernel's inputs --------------------------------------


def test_auto_picks_thd_on_cpu_and_varlen_says_why_it_cannot_run_here(processor):
    assert attention.resolve_attention("auto", "cpu") == "thd"
    assert "runs on CUDA only, not on cpu" in attention.varlen_problem("cpu")
    model = _model(processor, "auto")  # on the CPU
    assert attention.text_attention(model) == "thd"
    assert model.config.text_config._attn_implementation == THD_ATTENTION


def _packed_row(processor):
    """A real packed row: three conversations, alignment gaps, a fixed-width tail."""
    from packline.packing.thd import EncodedConversation, build_packed_batch

    convs = [
        EncodedConversation(
            key=k,
            input_ids=torch.randint(10, 200, (n,)),
            target_mask=torch.ones(n, dtype=torch.bool),
            mrope=torch.arange(n).expand(3, n),
        )
        for k, n in (("a", 7), ("b", 3), ("c", 5))
    ]
    return build_packed_batch(convs, seq_length=24, alignment=4, pad_to_max_length=True)


def test_varlen_inputs_are_the_packers_boundaries_and_give_thds_attention(processor):
    """The row's cu_seqlens and longest segment reach the kernel as the packer made them
    (no search of the positions); the [T, H, D] layout, run segment by segment as the
    kernel runs it, gives thd's output (the kernel itself runs on a GPU only)."""
    row_batch = _packed_row(processor)
    row = attention.PackedRow(row_batch.cu_seqlens_padded, row_batch.max_seqlen)
    assert row.cu_seqlens.tolist() == [0, 8, 12, 24] and row.max_seqlen == 12
    assert row.bounds() == [(0, 8), (8, 12), (12, 24)]
    heads, kv_heads, dim, length = 4, 2, 8, 24
    query = torch.randn(1, heads, length, dim)
    key, value = torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
    q, k, v, cu, longest, extra = attention.varlen_inputs(query, key, value, row)
    assert q.shape == (length, heads, dim) and cu is row.cu_seqlens and longest == 12
    assert cu.dtype == torch.int32
    kernel = attention._varlen_kernel()
    if kernel is not None and kernel[2]:  # this torch's kernel takes GQA itself
        assert k.shape == (length, kv_heads, dim) and extra.get("enable_gqa") is True
    else:
        assert k.shape == (length, heads, dim)
    causal = {"window_size": (-1, 0)} if "window_size" in str(kernel) else {"is_causal": True}
    assert {key: extra[key] for key in causal} == causal
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    by_segment = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)
            for s, e in row.bounds()
        ]
    )  # fmt: skip

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads
        is_causal = True
        training = False

    thd, _ = attention.thd_attention_forward(
        Module(), query, key, value, None, packline_row=row, position_ids=None
    )
    assert torch.allclose(by_segment.unsqueeze(0), thd, atol=1e-6)


def test_flex_has_no_backward_on_cpu_in_this_torch(processor):
    """The bound behind flex's CPU checks: its forward equals thd's (the packing test of
    record runs it), a forward that will need a backward raises here, so LoRA gradients
    through flex are compared on a GPU (``packline bench gpu``). When PyTorch adds a CPU
    backward this fails: then compare the gradients here too."""
    model = set_text_attention(build_tiny_model(processor, seed=1), "flex")
    ids = torch.randint(10, 200, (1, 8))
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]).view(1, 1, -1).expand(4, 1, -1)
    with torch.no_grad():  # evaluation: runs
        model(input_ids=ids, position_ids=positions, use_cache=False)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        model(input_ids=ids, position_ids=positions, use_cache=False).logits.sum().backward()
