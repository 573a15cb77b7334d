"""The test of record: packing is invisible to the model's math.

Every conversation's logits inside a packed THD row equal its solo, unpadded run, for
tiny dense and MoE Qwen3-VL models under sdpa, eager, packline_thd and HF's flex_attention
(its document block mask, compiled on first use; fp32), on
rows that mix multi-image, single-image, video (an odd sampled frame count, two videos, a
video beside an image) and text-only conversations with alignment gaps and tail padding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packline.media.video import probe_video, write_video
from packline.packing.thd import build_packed_batch, shifted_labels
from packline.qwen.attention import THD_ATTENTION, set_text_attention
from packline.qwen.encode import ConversationEncoder
from packline.qwen.forward import packed_forward, token_hits, token_loss_sum
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import copy_tiny_processor
from tests.conftest import png_bytes


def _turns(*pairs):
    conv = []
    for user, assistant in pairs:
        conv.append({"role": "user", "content": user})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": assistant}]})
    return conv


def _clip(num_frames: int, height: int, width: int, fps: float) -> np.ndarray:
    """A square crossing a grey field, one step per frame."""
    frames = np.full((num_frames, height, width, 3), 90, dtype=np.uint8)
    for t in range(num_frames):
        x = (6 * t) % (width - 16)
        frames[t, 8:24, x : x + 16] = (220, 40, 40)
    return frames


IMG = {"type": "image"}
VID = {"type": "video"}
#: name → (frames, height, width, fps): 9 frames at 4 fps sample 4 (even), 13 sample 6,
#: 7 at 2 fps sample all 7 (odd: the last frame is repeated into the 4th group).
CLIPS = {"nine": (9, 64, 96, 4.0), "thirteen": (13, 96, 64, 4.0), "seven": (7, 64, 64, 2.0)}
VIDEO_CONVERSATIONS = [
    (
        "video",
        _turns(([VID, {"type": "text", "text": "Which way does the square move?"}], "Right.")),
        [],
        ["seven"],
    ),
    (
        "video+image",
        _turns(
            ([IMG, VID, {"type": "text", "text": "Is the square in the picture too?"}], "Yes."),
            ([VID, {"type": "text", "text": "And in this one?"}], "It moves down."),
        ),
        [png_bytes((128, 96), "red")],
        ["nine", "thirteen"],
    ),
]
CONVERSATIONS = [
    (  # two images, two turns
        "multi",
        _turns(
            ([IMG, IMG, {"type": "text", "text": "Which image has more shapes?"}], "The first."),
            ([{"type": "text", "text": "What colour is the circle?"}], "red"),
        ),
        [png_bytes((160, 96), "red"), png_bytes((96, 128), "blue")],
    ),
    ("text", _turns(([{"type": "text", "text": "How many sides has a hexagon?"}], "6")), []),
    (
        "single",
        [{"role": "system", "content": "Be brief."}]
        + _turns(([IMG, {"type": "text", "text": "Describe the picture."}], "A green circle.")),
        [png_bytes((200, 140), "green")],
    ),
]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> ConversationEncoder:
    return ConversationEncoder(copy_tiny_processor(tmp_path_factory.mktemp("proc")))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("clips")
    return {
        name: write_video(out / f"{name}.mp4", _clip(*spec), spec[-1]).read_bytes()
        for name, spec in CLIPS.items()
    }


@pytest.fixture(scope="module")
def convs(encoder, clips):
    """Text/image conversations and video ones interleaved: the row mixes them all."""
    out = [encoder.finish(encoder.tokenize(k, c, imgs)) for k, c, imgs in CONVERSATIONS]
    for i, (key, conv, images, names) in enumerate(VIDEO_CONVERSATIONS):
        videos = [clips[name] for name in names]
        headers = [probe_video(v) for v in videos]
        encoded = encoder.finish(encoder.tokenize(key, conv, images, videos, headers))
        out.insert(1 + 2 * i, encoded)
    frames = [c.video_frames for c in out]
    assert frames == [0, 7, 0, 10, 0], frames  # 7 (odd); 4 + 6
    return out


def _solo(model, encoder, conv):
    types = (conv.input_ids == encoder.image_token_id).long() + 2 * (
        conv.input_ids == encoder.video_token_id
    ).long()
    out = model(
        input_ids=conv.input_ids.view(1, -1),
        pixel_values=conv.pixel_values,
        image_grid_thw=conv.image_grid_thw,
        pixel_values_videos=conv.pixel_values_videos,
        video_grid_thw=conv.video_grid_thw,
        mm_token_type_ids=types.view(1, -1),
        use_cache=False,
    )
    return out.logits[0]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", THD_ATTENTION, "flex"])
@pytest.mark.parametrize(
    ("alignment", "pad_to_max"), [(1, False), (8, True)], ids=["m1", "m8-fixed"]
)
def test_packed_logits_equal_solo_runs(encoder, convs, moe, attn, alignment, pad_to_max):
    if attn == "flex":  # HF refuses flex at construction for dense Qwen3-VL; it runs it
        model = set_text_attention(build_tiny_model(encoder.processor, moe=moe, seed=3), "flex")
    else:
        model = build_tiny_model(encoder.processor, moe=moe, attn=attn, seed=3)
    batch = build_packed_batch(
        convs,
        seq_length=512,
        alignment=alignment,
        pad_to_max_length=pad_to_max,
        pad_token_id=encoder.pad_token_id,
        image_token_id=encoder.image_token_id,
        video_token_id=encoder.video_token_id,
    )
    assert batch.input_ids.shape[1] == (512 if pad_to_max else sum(len(c) for c in convs))
    assert batch.num_videos == 3 and batch.num_video_frames == 17
    with torch.no_grad():
        packed = packed_forward(
            model,
            batch,
            image_token_id=encoder.image_token_id,
            video_token_id=encoder.video_token_id,
        )[0]
        starts = batch.cu_seqlens_padded.tolist()
        solo_loss = torch.tensor(0.0)
        solo_targets = solo_hits = 0
        for conv, start in zip(convs, starts, strict=False):
            solo = _solo(model, encoder, conv)
            diff = (packed[start : start + len(conv)] - solo).abs().max().item()
            assert diff <= 1e-5, f"{conv.key}: max |packed - solo| = {diff:.2e}"
            labels = shifted_labels(conv.input_ids, conv.target_mask).view(1, -1)
            loss, n = token_loss_sum(solo.unsqueeze(0), labels)
            solo_loss += loss
            solo_targets += n
            solo_hits += token_hits(solo.unsqueeze(0), labels)
        packed_loss, packed_targets = token_loss_sum(packed.unsqueeze(0), batch.labels)
    assert packed_targets == solo_targets == batch.num_loss_tokens
    assert token_hits(packed.unsqueeze(0), batch.labels) == solo_hits  # eval/token_accuracy
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


def test_packed_row_counters_and_media_checks(encoder, convs):
    batch = build_packed_batch(
        convs,
        seq_length=1024,
        alignment=8,
        image_token_id=encoder.image_token_id,
        video_token_id=encoder.video_token_id,
    )
    lens = [len(c) for c in convs]
    assert batch.seq_lens == lens
    assert batch.cu_seqlens_padded.tolist() == [
        0,
        *torch.tensor([-(-n // 8) * 8 for n in lens]).cumsum(0).tolist(),
    ]
    assert batch.num_conversations == 5 and batch.num_images == 4 and batch.num_videos == 3
    assert batch.images_per_conversation == [2, 0, 0, 1, 1]
    assert batch.videos_per_conversation == [0, 1, 0, 2, 0]
    assert batch.num_real_tokens == sum(lens)
    assert batch.num_image_tokens == int((batch.input_ids == encoder.image_token_id).sum())
    assert batch.num_video_tokens == int((batch.input_ids == encoder.video_token_id).sum())
    assert batch.num_video_tokens == int(batch.video_grid_thw.prod(-1).sum()) // 4
    assert batch.position_ids[0, 0, : lens[0]].tolist() == list(range(lens[0]))
    assert batch.position_ids[0, 0, batch.cu_seqlens_padded[1]].item() == 0  # restarts
    # The row's conversations come back whole, media included (the packing-off baseline).
    for back, conv in zip(batch.conversations(), convs, strict=True):
        assert torch.equal(back.input_ids, conv.input_ids)
        assert torch.equal(back.mrope, conv.mrope)
        for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            a, b = getattr(back, name), getattr(conv, name)
            assert (a is None and b is None) or torch.equal(a, b), (conv.key, name)
        assert back.video_frames == conv.video_frames
    broken = convs[4]
    bad = type(broken)(**{**broken.__dict__, "image_grid_thw": broken.image_grid_thw * 2})
    with pytest.raises(ValueError, match="image patches in the grids"):
        build_packed_batch([bad], seq_length=512, image_token_id=encoder.image_token_id)
    video = convs[3]
    fewer = video.video_grid_thw.clone()
    fewer[0, 0] -= 1  # one temporal group fewer: pixels and placeholders disagree with it
    bad = type(video)(**{**video.__dict__, "video_grid_thw": fewer})
    with pytest.raises(ValueError, match="video patches in the grids"):
        build_packed_batch(
            [bad],
            seq_length=1024,
            image_token_id=encoder.image_token_id,
            video_token_id=encoder.video_token_id,
        )
    trimmed = type(video)(
        **{
            **video.__dict__,
            "pixel_values_videos": video.pixel_values_videos[: -fewer[0, 1:].prod()],
            "video_grid_thw": fewer,
        }
    )
    with pytest.raises(ValueError, match="video placeholder tokens but"):
        build_packed_batch(
            [trimmed],
            seq_length=1024,
            image_token_id=encoder.image_token_id,
            video_token_id=encoder.video_token_id,
        )
