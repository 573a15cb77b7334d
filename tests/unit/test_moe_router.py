"""The MoE router's statistics over real tokens only (packline.qwen.moe), on the real tiny
Qwen3-VL-MoE and real packed rows: alignment gaps and the fixed-width tail change neither the
load-balancing loss nor the expert loads, while HF's own ``aux_loss`` (``attention_mask=None``
on a packed row) counts them; the tiny MoE's expert sizes make a transposed expert layout fail
loudly."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLMoeForConditionalGeneration

from packline import metrics as M
from packline.packing.thd import EncodedConversation, build_packed_batch, build_padded_batch
from packline.qwen.encode import ConversationEncoder
from packline.qwen.forward import packed_forward, padded_forward
from packline.qwen.model import build_tiny_model, tiny_config
from packline.qwen.moe import RouterRecorder, RouterStats, aux_loss
from packline.qwen.processor import copy_tiny_processor
from tests.conftest import png_bytes

SEQ_LENGTH = 256
ALIGNMENT = 16
EPS32 = torch.finfo(torch.float32).eps


def _turns(*pairs):
    conv = []
    for user, assistant in pairs:
        conv.append({"role": "user", "content": [{"type": "text", "text": user}]})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": assistant}]})
    return conv


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> ConversationEncoder:
    return ConversationEncoder(copy_tiny_processor(tmp_path_factory.mktemp("proc")))


@pytest.fixture(scope="module")
def convs(encoder) -> list[EncodedConversation]:
    """An image conversation and two text ones (one of two turns): 24, 18 and 29 tokens."""
    image = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}
    ]
    image.append({"role": "assistant", "content": [{"type": "text", "text": "A red circle."}]})
    specs = [
        ("image", image, [png_bytes((96, 64), "red")]),
        ("text", _turns(("How many sides has a hexagon?", "6")), []),
        ("turns", _turns(("What colour?", "blue"), ("And?", "green")), []),
    ]
    return [encoder.finish(encoder.tokenize(key, conv, images)) for key, conv, images in specs]


def _row(encoder, convs, *, padded: bool):
    """The conversations packed tight (no gaps, no tail), or aligned to 16 at fixed width."""
    return build_packed_batch(
        convs,
        seq_length=SEQ_LENGTH,
        alignment=ALIGNMENT if padded else 1,
        pad_to_max_length=padded,
        pad_token_id=encoder.pad_token_id,
        image_token_id=encoder.image_token_id,
    )


def _packed_kwargs(encoder, batch) -> dict:
    """The inputs of :func:`packline.qwen.forward.packed_forward`."""
    return dict(
        input_ids=batch.input_ids,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        mm_token_type_ids=batch.token_type_ids(encoder.image_token_id),
        position_ids=batch.position_ids,
        attention_mask=None,
        use_cache=False,
    )


def _logits(model, encoder, batch) -> list[torch.Tensor]:
    with RouterRecorder(model) as rec, torch.no_grad():
        packed_forward(model, batch, image_token_id=encoder.image_token_id)
    return rec.logits


@pytest.fixture(scope="module")
def eager_model(encoder):
    """Under eager attention a real token's layer-0 router logits are bitwise the same in any
    row layout (sdpa's kernel differs by ~1e-7 between row lengths)."""
    return build_tiny_model(encoder.processor, moe=True, attn="eager", seed=3)


@pytest.fixture(scope="module")
def rows(encoder, convs):
    tight, padded = _row(encoder, convs, padded=False), _row(encoder, convs, padded=True)
    assert tight.num_padded_tokens == 0 and tight.input_ids.shape[1] == 71
    assert padded.cu_seqlens_padded.tolist() == [0, 32, 64, SEQ_LENGTH]
    assert padded.num_padded_tokens == SEQ_LENGTH - 71
    return tight, padded


# -- the real-token mask -----------------------------------------------------------------------


def test_real_token_mask_marks_each_conversation_not_gaps_or_the_tail(encoder, convs, rows):
    tight, padded = rows
    assert tight.real_token_mask().all() and tight.real_token_mask().shape == (1, 71)
    mask = padded.real_token_mask()
    assert mask.dtype == torch.bool and mask.shape == (1, SEQ_LENGTH)
    expected = torch.zeros(SEQ_LENGTH, dtype=torch.bool)
    for start, n in zip([0, 32, 64], [24, 18, 29], strict=True):
        expected[start : start + n] = True
    assert torch.equal(mask[0], expected)
    assert torch.equal(padded.input_ids[mask], tight.input_ids[0])
    empty = build_packed_batch([], seq_length=8)
    assert empty.real_token_mask().shape == (1, 0)
    unpacked = build_padded_batch(convs, pad_token_id=encoder.pad_token_id)
    assert torch.equal(unpacked.real_token_mask(), unpacked.attention_mask.bool())


# -- the loss over real tokens ------------------------------------------------------------------


def test_aux_loss_and_stats_ignore_whatever_the_gaps_and_tail_hold(rows, eager_model, encoder):
    """The tight row's router logits laid out as in the padded row, the pads' logits all on
    expert 0: the stats are bitwise those of the tight row, the loss equal up to float32
    summation order (HF sums the masked probabilities in float32; measured 0 or 1 ulp,
    2.4e-7), and far from the loss counting every token."""
    tight, padded = rows
    logits = _logits(eager_model, encoder, tight)
    mask = padded.real_token_mask()
    laid_out = []
    for layer in logits:
        full = torch.full((SEQ_LENGTH, 8), -5.0)
        full[:, 0] = 20.0
        full[mask.view(-1)] = layer
        laid_out.append(full)
    size = dict(num_experts=8, top_k=2)
    expected = aux_loss(logits, tight.real_token_mask(), **size)
    torch.testing.assert_close(aux_loss(laid_out, mask, **size), expected, rtol=2 * EPS32, atol=0)
    stats = RouterStats.from_logits(laid_out, mask, 2)
    assert torch.equal(
        stats.to_tensor(), RouterStats.from_logits(logits, tight.real_token_mask(), 2).to_tensor()
    )
    assert aux_loss(laid_out, torch.ones_like(mask), **size).item() > 2 * expected.item()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_aux_loss_of_a_row_with_gaps_and_tail_equals_the_tight_row(
    encoder, rows, eager_model, attn
):
    """The same conversations packed with alignment gaps and a fixed-width tail, and packed
    tight, through the model: the same top-k assignments, the same loss to float32 rounding.
    Not bitwise: the pads are routed and dispatched too, which changes each expert's GEMM
    size (and, under sdpa, the kernel's row length), so the real tokens' router logits after
    layer 0 differ by up to 2.1e-7 (measured, seed 3: eager aux losses equal, 2.080496; sdpa
    differs by 0-1 ulp over seeds 0-3)."""
    model = (
        eager_model if attn == "eager" else build_tiny_model(encoder.processor, moe=True, seed=3)
    )
    tight, padded = rows
    tight_logits, padded_logits = _logits(model, encoder, tight), _logits(model, encoder, padded)
    assert len(tight_logits) == len(padded_logits) == 2  # one per MoE layer
    tight_mask, padded_mask = tight.real_token_mask(), padded.real_token_mask()
    if attn == "eager":  # layer 0's router reads the attention output only: bitwise equal
        assert torch.equal(tight_logits[0], padded_logits[0][padded_mask.view(-1)])
    size = dict(num_experts=8, top_k=2)
    ours_tight = aux_loss(tight_logits, tight_mask, **size)
    ours_padded = aux_loss(padded_logits, padded_mask, **size)
    torch.testing.assert_close(ours_padded, ours_tight, rtol=1e-6, atol=0)
    stats_tight = RouterStats.from_logits(tight_logits, tight_mask, 2)
    stats_padded = RouterStats.from_logits(padded_logits, padded_mask, 2)
    assert stats_padded.num_layer_tokens.item() == stats_tight.num_layer_tokens.item() == 2 * 71
    assert torch.equal(stats_padded.counts, stats_tight.counts)
    torch.testing.assert_close(stats_padded.prob_sums, stats_tight.prob_sums, rtol=1e-6, atol=0)


def test_hf_aux_loss_of_a_padded_packed_row_counts_the_padding(encoder, rows, eager_model):
    """HF's own value (``attention_mask=None``: every token of the row) is ours on the tight
    row, and on the padded one it is ours with every token counted: measured 2.166420 vs
    2.080496 over the 71 real tokens (185 pads)."""
    tight, padded = rows
    kwargs = dict(output_router_logits=True)
    size = dict(num_experts=8, top_k=2)
    with RouterRecorder(eager_model) as rec, torch.no_grad():
        hf_padded = eager_model(**_packed_kwargs(encoder, padded), **kwargs).aux_loss
        ours_padded = aux_loss(rec.logits, padded.real_token_mask(), **size)
        every_token = aux_loss(rec.logits, torch.ones_like(padded.real_token_mask()), **size)
        rec.clear()
        hf_tight = eager_model(**_packed_kwargs(encoder, tight), **kwargs).aux_loss
        ours_tight = aux_loss(rec.logits, tight.real_token_mask(), **size)
    torch.testing.assert_close(hf_tight, ours_tight, rtol=EPS32, atol=0)
    torch.testing.assert_close(hf_padded, every_token, rtol=EPS32, atol=0)
    assert hf_padded.item() - ours_padded.item() > 0.05


def test_aux_loss_trains_through_the_recorded_logits(encoder, rows):
    model = build_tiny_model(encoder.processor, moe=True, seed=3)
    _, padded = rows
    with RouterRecorder(model) as rec:
        packed_forward(model, padded, image_token_id=encoder.image_token_id)
    loss = aux_loss(rec.logits, padded.real_token_mask(), num_experts=8, top_k=2)
    loss.backward()
    router = model.model.language_model.layers[0].mlp.gate
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_aux_loss_refuses_logits_of_another_forward(rows, eager_model, encoder):
    tight, padded = rows
    logits = _logits(eager_model, encoder, tight)
    with pytest.raises(ValueError, match=r"do not match a mask of \(1, 256\)"):
        aux_loss(logits, padded.real_token_mask(), num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="no router logits"):
        aux_loss([], padded.real_token_mask(), num_experts=8, top_k=2)


# -- RouterStats -------------------------------------------------------------------------------


def test_router_stats_aux_loss_equals_aux_loss_of_one_micro_batch(encoder, rows, eager_model):
    _, padded = rows
    logits = _logits(eager_model, encoder, padded)
    mask = padded.real_token_mask()
    stats = RouterStats.from_logits(logits, mask, 2)
    assert (stats.num_experts, stats.top_k) == (8, 2)
    assert stats.counts.dtype == stats.prob_sums.dtype == torch.float64
    assert stats.counts.sum().item() == 2 * 2 * 71  # layers × real tokens × top-k
    assert stats.prob_sums.sum().item() == pytest.approx(2 * 71, abs=1e-5)  # float32 softmax
    assert not stats.counts.requires_grad
    ours = aux_loss(logits, mask, num_experts=8, top_k=2)
    assert abs(stats.aux_loss().item() - ours.item()) <= 1e-6


def test_stats_of_two_micro_batches_add_to_the_stats_of_both(encoder, convs, rows, eager_model):
    """Micro-batches {image, text} and {turns} summed = the row of all three; the aux loss of
    the sum is the loss of their union, not the mean of the two."""
    tight, _ = rows

    def stats(batch):
        return RouterStats.from_logits(
            _logits(eager_model, encoder, batch), batch.real_token_mask(), 2
        )

    first = stats(_row(encoder, convs[:2], padded=True))
    second = stats(_row(encoder, convs[2:], padded=True))
    both = stats(tight)
    summed = first + second
    assert torch.equal(summed.counts, both.counts)
    assert torch.equal(summed.num_layer_tokens, both.num_layer_tokens)
    # Not bitwise: the rows differ in layout (see the test of gaps and tail above).
    torch.testing.assert_close(summed.prob_sums, both.prob_sums, rtol=1e-6, atol=0)
    assert summed.aux_loss().item() == pytest.approx(both.aux_loss().item(), rel=1e-6)
    mean = (first.aux_loss().item() + second.aux_loss().item()) / 2
    assert abs(summed.aux_loss().item() - mean) > 1e-3
    zero = RouterStats.zeros(8, 2)
    assert torch.equal((zero + both).to_tensor(), both.to_tensor())


def test_packing_off_gives_the_same_router_stats(encoder, convs, rows, eager_model):
    """The same conversations one per padded row (2-D mask; HF's own M-RoPE): the same
    assignments, probabilities equal to float32 rounding."""
    tight, _ = rows
    packed = RouterStats.from_logits(
        _logits(eager_model, encoder, tight), tight.real_token_mask(), 2
    )
    unpacked_batch = build_padded_batch(convs, pad_token_id=encoder.pad_token_id)
    with RouterRecorder(eager_model) as rec, torch.no_grad():
        padded_forward(eager_model, unpacked_batch, image_token_id=encoder.image_token_id)
    unpacked = RouterStats.from_logits(rec.logits, unpacked_batch.real_token_mask(), 2)
    assert torch.equal(unpacked.counts, packed.counts)
    assert torch.equal(unpacked.num_layer_tokens, packed.num_layer_tokens)
    torch.testing.assert_close(unpacked.prob_sums, packed.prob_sums, rtol=1e-5, atol=0)


def test_stats_round_trip_through_one_flat_tensor_and_sum_like_all_reduce(
    encoder, convs, eager_model
):
    batches = [_row(encoder, convs[i : i + 1], padded=True) for i in range(3)]
    parts = [
        RouterStats.from_logits(_logits(eager_model, encoder, b), b.real_token_mask(), 2)
        for b in batches
    ]
    flat = parts[0].to_tensor()
    assert flat.shape == (2 * 8 + 1,) and flat.dtype == torch.float64
    back = RouterStats.from_tensor(flat, top_k=2)
    for name in ("counts", "prob_sums", "num_layer_tokens"):
        assert torch.equal(getattr(back, name), getattr(parts[0], name))
    assert (back.num_experts, back.top_k) == (8, 2)
    reduced = RouterStats.from_tensor(sum(p.to_tensor() for p in parts), top_k=2)
    added = parts[0] + parts[1] + parts[2]
    assert torch.equal(reduced.to_tensor(), added.to_tensor())
    with pytest.raises(ValueError, match="2E \\+ 1 values"):
        RouterStats.from_tensor(flat[:-1], top_k=2)
    with pytest.raises(ValueError, match="cannot be added"):
        parts[0] + RouterStats.zeros(4, 2)


def test_expert_loads_are_assignments_over_their_mean():
    stats = RouterStats(
        num_experts=4,
        top_k=2,
        counts=torch.tensor([4.0, 2.0, 2.0, 0.0], dtype=torch.float64),
        prob_sums=torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64),
        num_layer_tokens=torch.tensor(4.0, dtype=torch.float64),
    )
    loads = stats.expert_loads()
    assert loads.tolist() == [2.0, 1.0, 1.0, 0.0]
    assert loads.sum().item() == 4 and loads.mean().item() == 1.0
    # HF's formula: 4 · Σ (counts / 4) · (prob_sums / 4) = 4 · (2 + 0.5 + 0.5) / 4 = 3
    assert stats.aux_loss().item() == 3.0
    assert stats.metrics() == {
        M.MOE_AUX_LOSS: 3.0,
        M.MOE_EXPERT_LOAD_MAX: 2.0,
        M.MOE_EXPERT_LOAD_MIN: 0.0,
    }
    assert set(stats.metrics()) == set(M.MOE_METRICS) and all(map(M.defines, M.MOE_METRICS))
    balanced = RouterStats(
        num_experts=4,
        top_k=2,
        counts=torch.full((4,), 2.0, dtype=torch.float64),
        prob_sums=torch.full((4,), 1.0, dtype=torch.float64),
        num_layer_tokens=torch.tensor(4.0, dtype=torch.float64),
    )
    assert balanced.expert_loads().tolist() == [1.0] * 4
    assert balanced.aux_loss().item() == 2.0  # a balanced router's loss is top_k


def test_stats_of_no_logits_are_zeros_given_the_experts(rows):
    mask = rows[1].real_token_mask()
    empty = RouterStats.from_logits([], mask, 2, num_experts=8)
    assert empty.to_tensor().tolist() == [0.0] * 17
    with pytest.raises(ValueError, match="pass num_experts"):
        RouterStats.from_logits([], mask, 2)


# -- the recorder ------------------------------------------------------------------------------


def test_recorder_removes_its_hooks_on_exit(encoder, rows, eager_model):
    tight, _ = rows
    rec = RouterRecorder(eager_model)
    assert (rec.num_experts, rec.top_k) == (8, 2) and len(rec.routers) == 2
    with torch.no_grad():  # HF installs its own (output capturing) hooks: count them after it
        packed_forward(eager_model, tight, image_token_id=encoder.image_token_id)
    hooks = [dict(r._forward_hooks) for r in rec.routers]
    with rec, torch.no_grad():
        packed_forward(eager_model, tight, image_token_id=encoder.image_token_id)
        assert [t.shape for t in rec.logits] == [(71, 8), (71, 8)]
        kept = rec.logits
        rec.clear()
        assert rec.logits == [] and len(kept) == 2
        packed_forward(eager_model, tight, image_token_id=encoder.image_token_id)
        assert len(rec.logits) == 2
    assert [dict(r._forward_hooks) for r in rec.routers] == hooks
    rec.clear()
    with torch.no_grad():
        packed_forward(eager_model, tight, image_token_id=encoder.image_token_id)
    assert rec.logits == []


def test_recorder_on_part_of_the_layers_and_on_a_dense_model(encoder, eager_model):
    """A pipeline stage holds only some decoder layers, and maybe no config: the sizes then
    come from its routers."""
    text = eager_model.model.language_model
    assert (RouterRecorder(text).num_experts, RouterRecorder(text).top_k) == (8, 2)
    stage = torch.nn.ModuleList(text.layers[1:])
    rec = RouterRecorder(stage)
    assert (rec.num_experts, rec.top_k, len(rec.routers)) == (8, 2, 1)
    hidden = torch.randn(1, 5, 128)
    with rec, torch.no_grad():
        stage[0].mlp(hidden)
    assert len(rec.logits) == 1 and rec.logits[0].shape == (5, 8)
    dense = build_tiny_model(encoder.processor)
    with pytest.raises(ValueError, match="is not a Qwen3-VL-MoE model"):
        RouterRecorder(dense)


def test_recorder_on_a_peft_model_trains_the_adapters_through_the_aux_loss(encoder, rows):
    _, padded = rows
    base = build_tiny_model(encoder.processor, moe=True, seed=3)
    model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    rec = RouterRecorder(model)
    assert (rec.num_experts, rec.top_k, len(rec.routers)) == (8, 2, 2)
    with rec:
        packed_forward(model, padded, image_token_id=encoder.image_token_id)
    assert len(rec.logits) == 2 and all(t.requires_grad for t in rec.logits)
    aux_loss(rec.logits, padded.real_token_mask(), num_experts=8, top_k=2).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    q_b = [g for n, g in grads.items() if "layers.0.self_attn.q_proj.lora_B" in n]
    assert q_b and q_b[0].abs().sum() > 0  # layer 0's routers read its attention output


# -- the expert layout (transformers #47031) ---------------------------------------------------


@pytest.mark.parametrize("name", ["gate_up_proj", "down_proj"])
def test_a_state_dict_with_transposed_experts_fails_to_load(encoder, name):
    text = tiny_config(encoder.processor, moe=True).text_config
    assert 2 * text.moe_intermediate_size != text.hidden_size
    assert text.moe_intermediate_size != text.hidden_size
    model = build_tiny_model(encoder.processor, moe=True)
    state = model.state_dict()
    key = f"model.language_model.layers.0.mlp.experts.{name}"
    state[key] = state[key].transpose(1, 2).contiguous()
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
        model.load_state_dict(state)


@pytest.mark.parametrize("moe_intermediate_size", [48, 64], ids=["tiny", "square-64"])
def test_hf_loads_the_hub_expert_layout_right_only_when_shapes_tell(
    encoder, tmp_path, moe_intermediate_size
):
    """Hub checkpoints store experts transposed; HF transposes them back only when the shape
    differs from the model's. The tiny MoE's 48 lets it; with 2 × 64 = hidden 128 (the old
    tiny size) gate_up_proj loads transposed, silently."""
    config = tiny_config(encoder.processor, moe=True)
    config.text_config.moe_intermediate_size = moe_intermediate_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3VLMoeForConditionalGeneration(config).float()
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if ".mlp.experts." in k]:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()  # the Hub layout
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path)
    experts, back = model.model.language_model.layers[0].mlp.experts, loaded.model.language_model
    back = back.layers[0].mlp.experts
    assert torch.equal(back.down_proj, experts.down_proj)
    same = torch.equal(back.gate_up_proj, experts.gate_up_proj)
    assert same is (moe_intermediate_size == 48)


def test_ep_keeps_the_expert_stacks_in_host_ram_and_places_the_rest(encoder):
    """Before the split, every weight but the expert stacks goes to the rank's device; the
    stacks stay on the host for the split to take this rank's slice of each (here the
    device is ``meta``, so what moved is plain to see without a GPU)."""
    from packline.train.expert_parallel import expert_stacks, place_but_experts
    from schemas.layout import ParallelLayout

    model = build_tiny_model(encoder.processor, moe=True, seed=3)
    stacks = expert_stacks(model, ParallelLayout(world=2, expert=2, fsdp=True))
    n_layers = model.config.text_config.num_hidden_layers
    assert stacks == {
        f"model.language_model.layers.{i}.mlp.experts.{p}"
        for i in range(n_layers)
        for p in ("gate_up_proj", "down_proj")
    }
    assert expert_stacks(model, ParallelLayout(world=2)) == set()
    place_but_experts(model, torch.device("meta"), stacks)
    where = {n: p.device.type for n, p in model.named_parameters()}
    assert {n for n, d in where.items() if d == "cpu"} == stacks
    assert all(b.device.type == "meta" for b in model.buffers())
