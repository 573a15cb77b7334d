"""The test of record: packing is invisible to the model's math.

Every conversation's logits inside a packed THD row equal its solo, unpadded run, for
tiny dense and MoE Qwen3-VL models under sdpa, eager and packline_thd attention (fp32), on
rows that mix multi-image, single-image and text-only conversations with alignment gaps and
tail padding.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image, ImageDraw

from packline.packing.thd import build_packed_batch, shifted_labels
from packline.qwen.attention import THD_ATTENTION
from packline.qwen.encode import ConversationEncoder
from packline.qwen.forward import packed_forward, token_loss_sum
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor


def _png(size: tuple[int, int], colour: str) -> bytes:
    img = Image.new("RGB", size, "grey")
    ImageDraw.Draw(img).ellipse([8, 8, size[0] // 2, size[1] // 2], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _turns(*pairs):
    conv = []
    for user, assistant in pairs:
        conv.append({"role": "user", "content": user})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": assistant}]})
    return conv


IMG = {"type": "image"}
CONVERSATIONS = [
    (  # two images, two turns
        "multi",
        _turns(
            ([IMG, IMG, {"type": "text", "text": "Which image has more shapes?"}], "The first."),
            ([{"type": "text", "text": "What colour is the circle?"}], "red"),
        ),
        [_png((160, 96), "red"), _png((96, 128), "blue")],
    ),
    ("text", _turns(([{"type": "text", "text": "How many sides has a hexagon?"}], "6")), []),
    (
        "single",
        [{"role": "system", "content": "Be brief."}]
        + _turns(([IMG, {"type": "text", "text": "Describe the picture."}], "A green circle.")),
        [_png((200, 140), "green")],
    ),
]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> ConversationEncoder:
    return ConversationEncoder(copy_tiny_processor(tmp_path_factory.mktemp("proc")))


@pytest.fixture(scope="module")
def convs(encoder):
    return [encoder.finish(encoder.tokenize(k, c, imgs)) for k, c, imgs in CONVERSATIONS]


def _solo(model, encoder, conv):
    out = model(
        input_ids=conv.input_ids.view(1, -1),
        pixel_values=conv.pixel_values,
        image_grid_thw=conv.image_grid_thw,
        mm_token_type_ids=(conv.input_ids == encoder.image_token_id).long().view(1, -1),
        use_cache=False,
    )
    return out.logits[0]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", THD_ATTENTION])
@pytest.mark.parametrize(
    ("alignment", "pad_to_max"), [(1, False), (8, True)], ids=["m1", "m8-fixed"]
)
def test_packed_logits_equal_solo_runs(encoder, convs, moe, attn, alignment, pad_to_max):
    model = build_tiny_model(encoder.processor, moe=moe, attn=attn, seed=3)
    batch = build_packed_batch(
        convs,
        seq_length=512,
        alignment=alignment,
        pad_to_max_length=pad_to_max,
        pad_token_id=encoder.pad_token_id,
        image_token_id=encoder.image_token_id,
    )
    assert batch.input_ids.shape[1] == (512 if pad_to_max else sum(len(c) for c in convs))
    with torch.no_grad():
        packed = packed_forward(model, batch, image_token_id=encoder.image_token_id)[0]
        starts = batch.cu_seqlens_padded.tolist()
        solo_loss = torch.tensor(0.0)
        solo_targets = 0
        for conv, start in zip(convs, starts, strict=False):
            solo = _solo(model, encoder, conv)
            diff = (packed[start : start + len(conv)] - solo).abs().max().item()
            assert diff <= 1e-5, f"{conv.key}: max |packed - solo| = {diff:.2e}"
            loss, n = token_loss_sum(
                solo.unsqueeze(0), shifted_labels(conv.input_ids, conv.target_mask).view(1, -1)
            )
            solo_loss += loss
            solo_targets += n
        packed_loss, packed_targets = token_loss_sum(packed.unsqueeze(0), batch.labels)
    assert packed_targets == solo_targets == batch.num_loss_tokens
    assert packed_loss.item() == pytest.approx(solo_loss.item(), rel=1e-6)


def test_contaminating_inputs_raise(encoder, convs):
    model = build_tiny_model(encoder.processor)
    batch = build_packed_batch(convs, seq_length=512, image_token_id=encoder.image_token_id)
    image_id = encoder.image_token_id
    with pytest.raises(ValueError, match="attention_mask of shape \\(1, \\d+\\) given"):
        packed_forward(
            model, batch, image_token_id=image_id, attention_mask=torch.ones_like(batch.input_ids)
        )
    with pytest.raises(ValueError, match="position_ids of shape \\(3, 1, \\d+\\)"):
        packed_forward(model, batch, image_token_id=image_id, position_ids=batch.position_ids[1:])
    with pytest.raises(ValueError, match="use_cache=True"):
        packed_forward(model, batch, image_token_id=image_id, use_cache=True)
    with pytest.raises(ValueError, match="use_cache=None"):
        packed_forward(model, batch, image_token_id=image_id, use_cache=None)


def test_the_guard_is_needed_a_2d_mask_really_contaminates(encoder, convs):
    """Without the guard, a 2-D mask of ones silently changes the second conversation."""
    model = build_tiny_model(encoder.processor)
    batch = build_packed_batch(convs, seq_length=512, image_token_id=encoder.image_token_id)
    kwargs = dict(
        input_ids=batch.input_ids,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        mm_token_type_ids=batch.token_type_ids(encoder.image_token_id),
        position_ids=batch.position_ids,
        use_cache=False,
    )
    with torch.no_grad():
        isolated = model(**kwargs, attention_mask=None).logits
        leaked = model(**kwargs, attention_mask=torch.ones_like(batch.input_ids)).logits
    second = slice(len(convs[0]), len(convs[0]) + len(convs[1]))
    assert (isolated[0, second] - leaked[0, second]).abs().max().item() > 1e-3


def test_packed_row_counters_and_image_check(encoder, convs):
    batch = build_packed_batch(
        convs, seq_length=512, alignment=8, image_token_id=encoder.image_token_id
    )
    lens = [len(c) for c in convs]
    assert batch.seq_lens == lens
    assert batch.cu_seqlens_padded.tolist() == [
        0,
        *torch.tensor([-(-n // 8) * 8 for n in lens]).cumsum(0).tolist(),
    ]
    assert batch.num_conversations == 3 and batch.num_images == 3
    assert batch.num_real_tokens == sum(lens)
    assert batch.num_image_tokens == int((batch.input_ids == encoder.image_token_id).sum())
    assert batch.position_ids[0, 0, : lens[0]].tolist() == list(range(lens[0]))
    assert batch.position_ids[0, 0, batch.cu_seqlens_padded[1]].item() == 0  # restarts
    broken = convs[2]
    bad = type(broken)(**{**broken.__dict__, "image_grid_thw": broken.image_grid_thw * 2})
    with pytest.raises(ValueError, match="patches in the grids"):
        build_packed_batch([bad], seq_length=512, image_token_id=encoder.image_token_id)
