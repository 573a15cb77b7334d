import numpy as np
import pytest
import torch
from PIL import Image

from packline.counters import (
    FlopsModel,
    PackCounts,
    RunningCounters,
    layout_counts,
    layout_metrics,
    row_fills,
)
from packline.flops import PackShape, step_flops
from packline.packing.thd import EncodedConversation, build_packed_batch, build_padded_batch
from packline.qwen.model import tiny_config
from packline.qwen.processor import (
    copy_tiny_processor,
    load_processor,
    processor_video_geometry,
    special_token_ids,
)


def test_layout_metrics_of_packed_rows_count_fill_against_seq_length():
    m = layout_metrics([1536, 1024], conversations=6, padded_tokens=0, seq_length=2048)
    assert m == {
        "pack/rows": 2.0,
        "pack/fill": 2560 / 4096,
        "pack/conversations_per_pack": 3.0,
        "pack/padding_tokens": 0.0,
        "pack/padding_fraction": 0.0,
    }


def test_layout_metrics_when_unpacked_have_one_row_per_conversation_and_count_padding():
    rows = [100, 300, 200]  # one conversation per row, padded to 300 in one micro-batch
    m = layout_metrics(rows, conversations=3, padded_tokens=300, seq_length=1000)
    assert m["pack/rows"] == 3.0 and m["pack/conversations_per_pack"] == 1.0
    assert m["pack/fill"] == 600 / 3000
    assert m["pack/padding_tokens"] == 300.0
    assert m["pack/padding_fraction"] == 300 / 900
    assert row_fills(rows, 1000) == [0.1, 0.3, 0.2]


def test_layout_metrics_of_no_rows_are_zero():
    m = layout_metrics([], conversations=0, padded_tokens=0, seq_length=2048)
    assert set(m.values()) == {0.0}


def test_running_counters_restore_checkpoints_written_before_the_tokens_real_name():
    counters = RunningCounters.fresh()
    counters.load_state_dict({"rows": 2, "real_tokens": 300, "padded_tokens": 4})
    assert (counters.total.rows, counters.total.tokens_real, counters.total.padded_tokens) == (
        2,
        300,
        4,
    )
    assert counters.state_dict()["tokens_real"] == 300


# -- a packed row holding videos ------------------------------------------------------------

# (clip (frames, fps, (height, width)) or None, image sizes): the processor samples at 2 fps,
# so 5 frames at 2 fps keep all 5 (odd: padded to grid (3, 4, 6), 18 tokens), 6 frames at
# 4 fps keep 4 (grid (2, 6, 8), 24 tokens); the 64x64 image is (1, 4, 4), 4 tokens.
ROW = [((5, 2.0, (64, 96)), ()), (None, ((64, 64),)), ((6, 4.0, (96, 128)), ()), (None, ())]
VIDEO_GRIDS = ((3, 4, 6), (2, 6, 8))


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(copy_tiny_processor(tmp_path_factory.mktemp("counters") / "processor"))


def _encoded(processor, key: str, clip, image_sizes) -> EncodedConversation:
    """One conversation as the processor encodes it, by hand into an EncodedConversation."""
    content = [{"type": "video"}] if clip else []
    content += [{"type": "image"} for _ in image_sizes]
    content.append({"type": "text", "text": "What happens?"})
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": "A red circle moves left."},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    kwargs, frames = {}, 0
    if clip:
        num_frames, fps, (height, width) = clip
        rng = np.random.default_rng(num_frames)
        video = rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
        kwargs["videos"] = [video]
        kwargs["videos_kwargs"] = {"video_metadata": [{"total_num_frames": num_frames, "fps": fps}]}
        frames = processor_video_geometry(processor).num_sampled(num_frames, fps)
    if image_sizes:
        kwargs["images"] = [Image.new("RGB", size, (10, 200, 30)) for size in image_sizes]
    out = processor(text=[text], return_tensors="pt", **kwargs)
    ids = out["input_ids"][0]
    target = torch.zeros(len(ids), dtype=torch.bool)
    target[-8:] = True  # the reply and its <|im_end|>
    return EncodedConversation(
        key=key,
        input_ids=ids,
        target_mask=target,
        mrope=torch.arange(len(ids)).expand(3, -1),  # positions do not enter the counters
        pixel_values=out.get("pixel_values"),
        image_grid_thw=out.get("image_grid_thw"),
        pixel_values_videos=out.get("pixel_values_videos"),
        video_grid_thw=out.get("video_grid_thw"),
        video_frames=frames,
    )


def test_pack_counts_of_a_row_with_videos_count_sampled_frames_tokens_and_vision_flops(
    processor,
):
    ids = special_token_ids(processor)
    convs = [_encoded(processor, f"c{i}", clip, sizes) for i, (clip, sizes) in enumerate(ROW)]
    assert [c.video_frames for c in convs] == [5, 0, 4, 0]
    row = build_packed_batch(
        convs,
        seq_length=512,
        alignment=8,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
    )
    model = FlopsModel(config=tiny_config(processor), lora_rank=8)
    counts = PackCounts.of(row, model, 512)

    assert row.video_grid_thw.tolist() == [list(g) for g in VIDEO_GRIDS]
    assert (counts.videos, counts.video_frames, counts.video_tokens) == (2, 9, 18 + 24)
    assert counts.video_tokens == int((row.input_ids == ids["video_token_id"]).sum())
    assert (counts.images, counts.image_tokens) == (1, 4)
    shape = PackShape(
        seq_lens=row.seq_lens,
        image_grids=((1, 4, 4),),
        video_grids=VIDEO_GRIDS,
        padded_len=row.input_ids.shape[1],
        loss_tokens=row.num_loss_tokens,
    )
    flops = step_flops(model.config, shape, mode="lora", lora_rank=8)
    assert counts.flops_useful == flops.total
    without_videos = model.useful(row.seq_lens, [(1, 4, 4)], row.input_ids.shape[1])
    assert counts.flops_useful - without_videos == flops.video_vision.total > 0

    # Packing off lays the same conversations out padded: the same videos, frames, tokens
    # and useful FLOPs; the executed FLOPs run the same ViT work next to the padded rows.
    assert layout_counts([row], [row], flops_model=model, seq_length=512, packed=True) == counts
    micro = [build_padded_batch(row.conversations(), pad_token_id=ids["pad_token_id"])]
    padded = layout_counts([row], micro, flops_model=model, seq_length=512, packed=False)
    for name in ("videos", "video_tokens", "video_frames", "images", "image_tokens"):
        assert getattr(padded, name) == getattr(counts, name), name
    assert padded.flops_useful == counts.flops_useful
    longest = micro[0].input_ids.shape[1]
    executed = step_flops(
        model.config,
        PackShape(
            seq_lens=(longest,) * 4,
            image_grids=((1, 4, 4),),
            video_grids=VIDEO_GRIDS,
            padded_len=4 * longest,
            loss_tokens=0,
        ),
        mode="lora",
        lora_rank=8,
    )
    assert padded.flops_executed == executed.total
    assert executed.video_vision == flops.video_vision
    assert padded.rows == 4 and padded.flops_executed > counts.flops_executed


def test_running_counters_restore_checkpoints_written_before_the_video_counters():
    counters = RunningCounters.fresh()
    counters.load_state_dict({"rows": 2, "tokens_real": 300, "images": 1, "image_tokens": 64})
    assert (counters.total.videos, counters.total.video_tokens, counters.total.video_frames) == (
        0,
        0,
        0,
    )
    assert counters.state_dict()["video_frames"] == 0


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3-vl-30b-a3b"])
def test_sample_flops_are_each_samples_executed_flops_and_add_up_to_a_packs(name):
    from packline.counters import FlopsModel
    from packline.qwen.real_configs import real_config

    model = FlopsModel(config=real_config(name), lora_rank=32)
    rows = [(3001, [(1, 32, 32)], []), (777, [], [(2, 16, 16)]), (50, [], []), (9000, [], [])]
    fast, fold = model.sample_flops(rows), model.per_call_flops()
    assert (fold > 0) == ("a3b" in name)  # the MoE experts' LoRA fold, once per call
    for (n, grids, videos), value in zip(rows, fast, strict=True):
        alone = model.executed([n], grids, video_grids=videos)
        assert value + fold == pytest.approx(alone, rel=1e-12)
    # a pack's FLOPs are its samples' plus the fold, once
    pack = model.executed([n for n, _, _ in rows], [(1, 32, 32)], video_grids=[(2, 16, 16)])
    assert sum(fast) + fold == pytest.approx(pack, rel=1e-12)
