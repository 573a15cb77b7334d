"""Exact step FLOPs: FlopCounterMode on tiny Qwen3-VL models, hand derivations on real ones.

The oracle for a packed row is the sum of ``FlopCounterMode`` over its conversations run solo
(unpadded, batch 1): that is what varlen/THD attention executes, whereas eager attention on
one packed row would compute the full T x T scores. MoE models run with
``experts_implementation="eager"``: ``FlopCounterMode`` does not see the default
``grouped_mm`` experts at all.

Videos are real clips through the tiny processor's video processor (frame sampling at its
2 fps, the whole-clip resize, odd sampled counts padded by the processor itself), and the
model gets them as training does: ``pixel_values_videos``, ``video_grid_thw`` and
``mm_token_type_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

from packline.flops import (
    PEAK_BF16_DENSE_TFLOPS,
    Flops,
    PackShape,
    lm_num_params,
    mfu,
    nominal_flops,
    step_flops,
)
from packline.qwen.model import build_tiny_model, tiny_config
from packline.qwen.processor import (
    copy_tiny_processor,
    load_processor,
    processor_video_geometry,
)
from packline.qwen.real_configs import QWEN3_VL_CONFIGS, real_config

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANK = 8

# PEFT 0.21 calls a deprecated transformers helper while wrapping the model.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

# (image sizes (width, height), question, answer); the tiny processor gives grids
# 64x64 -> (1, 4, 4), 96x128 -> (1, 8, 6), 160x96 -> (1, 6, 10).
CONVERSATIONS = [
    ((), "How many shapes are there?", "Three: a red circle, a blue square and a star."),
    (((64, 64),), "What colour is it?", "Red."),
    ((), "Say hello.", "Hello there, friend."),
    (((96, 128),), "Where is the green hexagon?", "It is in the bottom right."),
    (((160, 96), (64, 64)), "Which image has more triangles?", "The first one has two."),
    ((), "Count to five.", "One, two, three, four, five."),
]
# (clip (frames, fps, (height, width)), image sizes, question, answer), indices 6, 7, 8. The
# processor samples at 2 fps: 5 frames at 2 fps -> all 5 (odd: padded to 6, grid (3, 4, 6));
# 6 frames at 4 fps -> 4 sampled, grid (2, 6, 8); 9 frames at 2 fps -> all 9 (odd, grid
# (5, 4, 6)), in a conversation that also holds a 64x64 image.
VIDEO_CONVERSATIONS = [
    ((5, 2.0, (64, 96)), (), "Which way does the circle move?", "To the left."),
    ((6, 4.0, (96, 128)), (), "What appears second?", "A blue square."),
    ((9, 2.0, (64, 96)), ((64, 64),), "Is the star of the picture in the clip?", "Yes."),
]
VIDEO_GRIDS = {6: (3, 4, 6), 7: (2, 6, 8), 8: (5, 4, 6)}
PACKS = {
    "1 conversation, text only": [0],
    "2 conversations, 1 image": [1, 2],
    "3 conversations, 3 images": [3, 4, 5],
    "4 conversations, 2 images": [0, 1, 2, 3],
    "video, image, text only": [6, 1, 2],
    "2 videos, 1 image": [7, 8],
}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(copy_tiny_processor(tmp_path_factory.mktemp("flops") / "processor"))


@pytest.fixture(scope="module")
def conversations(processor) -> list[dict]:
    out = []
    for i, (sizes, question, answer) in enumerate(CONVERSATIONS):
        images = [Image.new("RGB", size, (40 * i, 200 - 30 * i, 90)) for size in sizes]
        content = [{"type": "image", "image": image} for image in images]
        content.append({"type": "text", "text": question})
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": answer},
        ]
        out.append(
            processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="pt"
            )
        )
    for clip, sizes, question, answer in VIDEO_CONVERSATIONS:
        out.append(_video_conversation(processor, clip, sizes, question, answer))
    return out


def _clip(num_frames: int, height: int, width: int) -> np.ndarray:
    """(T, H, W, 3) uint8 frames, different every frame."""
    rng = np.random.default_rng(num_frames * height + width)
    return rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def _video_conversation(processor, clip, image_sizes, question, answer):
    """One conversation with a video (and images), as the processor encodes it."""
    num_frames, fps, (height, width) = clip
    images = [Image.new("RGB", size, (200, 60, 90)) for size in image_sizes]
    content = [{"type": "video"}, *({"type": "image"} for _ in images)]
    content.append({"type": "text", "text": question})
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": answer},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    return processor(
        text=[text],
        images=images or None,
        videos=[_clip(num_frames, height, width)],
        videos_kwargs={"video_metadata": [{"total_num_frames": num_frames, "fps": fps}]},
        return_tensors="pt",
    )


def _build(processor, variant: str):
    moe = variant.startswith("moe")
    model = build_tiny_model(processor, moe=moe, attn="eager")
    if moe:
        model.set_experts_implementation("eager")  # grouped_mm is invisible to FlopCounterMode
    if variant.endswith("frozen-vision"):
        model.model.visual.requires_grad_(False)
    if variant.endswith(("lora", "lora-head")):
        model = get_peft_model(
            model,
            LoraConfig(
                r=RANK,
                target_modules=LORA_MODULES + (["lm_head"] if variant.endswith("head") else []),
                target_parameters=LORA_EXPERTS if moe else None,
            ),
        )
    return model


@dataclass(frozen=True)
class Measured:
    forward: int
    backward: int
    forward_baddbmm: int  # PEFT's fold of LoRA into 3-D expert weights


@pytest.fixture(scope="module")
def measure(processor, conversations):
    """``measure(variant, i)``: FlopCounterMode of conversation i run solo, cached."""
    models: dict[str, torch.nn.Module] = {}
    cache: dict[tuple[str, int], Measured] = {}

    def run(variant: str, index: int) -> Measured:
        if (variant, index) not in cache:
            model = models.setdefault(variant, _build(processor, variant))
            batch = conversations[index]
            forward_counter = FlopCounterMode(display=False)
            with forward_counter:
                out = model(
                    input_ids=batch["input_ids"],
                    pixel_values=batch.get("pixel_values"),
                    image_grid_thw=batch.get("image_grid_thw"),
                    pixel_values_videos=batch.get("pixel_values_videos"),
                    video_grid_thw=batch.get("video_grid_thw"),
                    mm_token_type_ids=batch["mm_token_type_ids"],
                    labels=batch["input_ids"],
                    use_cache=False,
                )
            backward_counter = FlopCounterMode(display=False)
            with backward_counter:
                out.loss.backward()
            model.zero_grad(set_to_none=True)
            counts = forward_counter.get_flop_counts()["Global"]
            cache[variant, index] = Measured(
                forward=forward_counter.get_total_flops(),
                backward=backward_counter.get_total_flops(),
                forward_baddbmm=counts.get(torch.ops.aten.baddbmm, 0),
            )
        return cache[variant, index]

    return run


def _pack(conversations, indices, padding: int = 13) -> PackShape:
    seq_lens = tuple(conversations[i]["input_ids"].shape[1] for i in indices)

    def grids(key: str) -> tuple[tuple[int, int, int], ...]:
        return tuple(
            tuple(grid.tolist())
            for i in indices
            if key in conversations[i]
            for grid in conversations[i][key]
        )

    return PackShape(
        seq_lens=seq_lens,
        image_grids=grids("image_grid_thw"),
        video_grids=grids("video_grid_thw"),
        padded_len=sum(seq_lens) + padding,
        loss_tokens=sum(seq_lens) // 2,
    )


def _formula(config, pack: PackShape, variant: str, **kwargs):
    if variant.endswith("lora"):
        return step_flops(config, pack, mode="lora", lora_rank=RANK, **kwargs)
    if variant.endswith("lora-head"):
        targets = [*LORA_MODULES, "lm_head"]
        return step_flops(config, pack, mode="lora", lora_rank=RANK, lora_targets=targets, **kwargs)
    return step_flops(
        config, pack, mode="full", freeze_vision=variant.endswith("frozen-vision"), **kwargs
    )


def _config(processor, variant: str):
    return tiny_config(processor, moe=variant.startswith("moe"), attn="eager")


ORACLE_CASES = [
    (variant, pack_name)
    for variant in ("dense-full", "dense-lora", "moe-full")
    for pack_name in PACKS
] + [
    ("dense-full-frozen-vision", "3 conversations, 3 images"),
    ("dense-lora-head", "3 conversations, 3 images"),
    ("dense-full-frozen-vision", "2 videos, 1 image"),
]


@pytest.mark.parametrize(("variant", "pack_name"), ORACLE_CASES)
def test_step_flops_match_flop_counter_when_conversations_run_solo(
    processor, conversations, measure, variant, pack_name
):
    indices = PACKS[pack_name]
    pack = _pack(conversations, indices)
    oracle = [measure(variant, i) for i in indices]
    oracle_forward = sum(m.forward for m in oracle)
    oracle_total = oracle_forward + sum(m.backward for m in oracle)

    config = _config(processor, variant)
    forward_only = _formula(config, pack, variant, include_backward=False)
    full_step = _formula(config, pack, variant)

    assert forward_only.backward == 0
    assert forward_only.forward == pytest.approx(oracle_forward, rel=0.01)
    assert full_step.forward == forward_only.forward
    assert full_step.total == pytest.approx(oracle_total, rel=0.01)
    assert (pack.num_padding, len(pack.seq_lens)) == (13, len(indices))


def _tiny_expert_fold(processor) -> int:
    """Forward FLOPs of PEFT's per-call fold ``W + s·B·A`` of the LoRA-adapted experts."""
    text = _config(processor, "moe-lora").text_config
    # One baddbmm per adapted 3-D parameter and layer: experts x rank x (d_out x d_in) MACs.
    # gate_up_proj is hidden -> 2·moe_intermediate, down_proj is moe_intermediate -> hidden:
    # 8 experts x 8 x (128·96 + 48·128) = 1,179,648 MACs = 2,359,296 FLOPs per layer.
    per_layer = 2 * text.num_experts * RANK * 3 * text.moe_intermediate_size * text.hidden_size
    assert per_layer == 2_359_296
    return text.num_hidden_layers * per_layer  # 4,718,592


# text only, one image, two images, a video, a video and an image
@pytest.mark.parametrize("index", [0, 3, 4, 6, 8])
def test_moe_lora_matches_flop_counter_per_conversation_except_peft_validation_fold(
    processor, conversations, measure, index
):
    oracle = measure("moe-lora", index)
    single = _formula(_config(processor, "moe-lora"), _pack(conversations, [index]), "moe-lora")
    fold = _tiny_expert_fold(processor)
    # PEFT folds each adapted expert weight twice per forward: once inside
    # register_parametrization (a validation call whose result is discarded), once for use.
    assert oracle.forward_baddbmm == 2 * fold
    assert single.forward == pytest.approx(oracle.forward - fold, rel=0.01)
    assert single.backward == pytest.approx(oracle.backward, rel=0.01)


def test_moe_lora_expert_fold_is_counted_once_per_row(processor, conversations):
    config = _config(processor, "moe-lora")
    fold = _tiny_expert_fold(processor)
    indices = PACKS["3 conversations, 3 images"]
    pack = _formula(config, _pack(conversations, indices), "moe-lora")
    singles = [_formula(config, _pack(conversations, [i]), "moe-lora") for i in indices]
    # Forward fold once instead of three times, and its backward (dA and dB, 2x) likewise.
    assert sum(s.total for s in singles) - pack.total == 2 * 3 * fold
    assert sum(s.lm.total for s in singles) == pack.lm.total


def test_vision_flops_match_flop_counter_for_video_grid_per_temporal_slice(processor):
    model = build_tiny_model(processor, attn="eager")
    grids = [(3, 8, 8), (1, 4, 6)]
    patches = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.zeros(patches, 3 * 2 * 16 * 16)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.model.visual(pixel_values, grid_thw=torch.tensor(grids))
    pack = PackShape(seq_lens=(60,), image_grids=tuple(grids), padded_len=64, loss_tokens=10)
    vision = step_flops(model.config, pack, mode="lora", lora_rank=RANK).vision
    assert vision.backward == 0  # the frozen ViT builds no graph
    assert vision.forward == counter.get_total_flops()
    # Attention is per 8x8 slice: 2 blocks x 4·(3·64² + 24²)·64 = 6,586,368, not 4·192²·64·2.
    flops = step_flops(model.config, pack, mode="lora", lora_rank=RANK)
    assert flops.vision_attention.forward == 2 * 4 * (3 * 64**2 + 24**2) * 64 == 6_586_368


def test_video_conversations_carry_the_video_processors_sampled_and_padded_frames(
    processor, conversations
):
    geometry = processor_video_geometry(processor)
    video_token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for index, (clip, *_) in zip(VIDEO_GRIDS, VIDEO_CONVERSATIONS, strict=True):
        num_frames, fps, (height, width) = clip
        batch = conversations[index]
        sampled = geometry.num_sampled(num_frames, fps)
        t, h, w = VIDEO_GRIDS[index]
        assert batch["video_grid_thw"].tolist() == [[t, h, w]]
        assert geometry.grid_thw(sampled, height, width) == (t, h, w)
        assert t == -(-sampled // 2)  # temporal groups of 2 frames, an odd count rounded up
        assert batch["pixel_values_videos"].shape == (t * h * w, 3 * 2 * 16 * 16)
        assert int((batch["input_ids"] == video_token_id).sum()) == t * h * w // 4
        assert int((batch["mm_token_type_ids"] == 2).sum()) == t * h * w // 4
        # Each patch row is (channel, frame of the group, 16, 16): an odd sampled count
        # repeats the last frame into the last group, which still runs through the ViT.
        last = batch["pixel_values_videos"][(t - 1) * h * w :].view(-1, 3, 2, 256)
        assert torch.equal(last[:, :, 0], last[:, :, 1]) == (sampled % 2 == 1)
    assert [geometry.num_sampled(n, fps) for (n, fps, _), *_ in VIDEO_CONVERSATIONS] == [5, 4, 9]


@pytest.mark.parametrize("trainable", [False, True])
def test_vit_flops_of_a_video_grid_are_those_of_t_image_grids_under_flop_counter(
    processor, trainable
):
    model = build_tiny_model(processor, attn="eager")
    visual = model.model.visual.requires_grad_(trainable)

    def counted(grids) -> int:
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(patches, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
        counter = FlopCounterMode(display=False)
        with counter, torch.set_grad_enabled(trainable):
            out = visual(pixels, grid_thw=torch.tensor(grids))
            if trainable:  # every output the LM consumes: the merger and the DeepStack mergers
                loss = out.pooler_output.sum() + sum(f.sum() for f in out.deepstack_features)
                loss.backward()
        return counter.get_total_flops()

    video = counted([(5, 4, 6)])
    assert video == counted([(1, 4, 6)] * 5)  # 5 temporal groups cost 5 images of (4, 6)
    pack = PackShape(seq_lens=(40,), video_grids=((5, 4, 6),), padded_len=40, loss_tokens=1)
    mode = dict(mode="full") if trainable else dict(mode="lora", lora_rank=RANK)
    flops = step_flops(model.config, pack, **mode)
    assert flops.vision.total == flops.video_vision.total == video
    assert (flops.vision.backward > 0) == trainable


def test_video_flops_are_the_image_flops_of_each_temporal_group_and_split_out(processor):
    config = _config(processor, "dense-full")
    video = PackShape(seq_lens=(80,), video_grids=((3, 4, 6),), padded_len=80, loss_tokens=9)
    images = PackShape(seq_lens=(80,), image_grids=((1, 4, 6),) * 3, padded_len=80, loss_tokens=9)
    both = PackShape(
        seq_lens=(80,),
        image_grids=((1, 4, 6),) * 3,
        video_grids=((3, 4, 6),),
        padded_len=80,
        loss_tokens=9,
    )
    as_video, as_images, mixed = (step_flops(config, p, mode="full") for p in (video, images, both))
    assert as_video.vision == as_images.vision == as_video.video_vision
    assert as_images.video_vision == Flops()
    assert as_video.total == as_images.total  # the LM sees the same 80 tokens
    # Images and videos: two ViT passes, the parts cover both, video_vision is the video's.
    assert mixed.vision == as_images.vision + as_video.vision
    assert mixed.video_vision == as_video.vision
    logged = mixed.as_dict()
    assert logged["video_vision/forward"] == as_video.vision.forward
    parts = [k for k in logged if k.endswith("/forward") and not k.startswith("video_vision")]
    assert sum(logged[k] for k in parts) == logged["forward"] == mixed.forward
    # 5 sampled frames are padded to 6: the same grid (3, 4, 6), the same FLOPs, which 4
    # frames (grid (2, 4, 6)) do not have.
    geometry = processor_video_geometry(processor)
    assert geometry.grid_thw(5, 64, 96) == geometry.grid_thw(6, 64, 96) == (3, 4, 6)
    four = PackShape(seq_lens=(80,), video_grids=((2, 4, 6),), padded_len=80, loss_tokens=9)
    assert step_flops(config, four, mode="full").vision.forward * 3 == as_video.vision.forward * 2


def test_attention_follows_sum_of_squared_lengths_when_same_tokens_split_differently():
    config = real_config("qwen3-vl-8b")
    # 8B: 36 layers x 32 heads x head_dim 128 = 4096-wide q; QKᵀ + AV = 2 x 2 FLOPs per
    # (query, key, channel): 4 · Σlen² · 4096 · 36 forward.
    per_square_token = 4 * 4096 * 36
    splits = {
        (4096,): 16_777_216,
        (2048, 2048): 8_388_608,
        (1024, 1024, 2048): 6_291_456,
        (1000, 1000, 1000, 1096): 4_201_216,
    }
    results = {}
    for seq_lens, sum_sq in splits.items():
        pack = PackShape(seq_lens=seq_lens, padded_len=4096, loss_tokens=100)
        results[seq_lens] = step_flops(config, pack, mode="full")
        assert results[seq_lens].lm_attention.forward == per_square_token * sum_sq
        assert results[seq_lens].lm_attention.backward == 2 * per_square_token * sum_sq
    dense = {r.lm_dense for r in results.values()}
    heads = {r.lm_head for r in results.values()}
    assert len(dense) == 1 and len(heads) == 1  # linear layers see the same 4096 tokens


@pytest.mark.parametrize(
    ("name", "forward_per_token", "train_per_token"),
    [
        # Qwen3-VL-8B, one text-only conversation of S = 4096 tokens, full fine-tune.
        # h = 4096, L = 36, q = 32·128 = 4096, kv = 8·128 = 1024, I = 12288, V = 151936.
        # Linear MACs per token and layer: q h·q = 16,777,216; k, v 2·h·kv = 8,388,608;
        #   o q·h = 16,777,216; gate, up, down 3·h·I = 150,994,944 -> 192,937,984 MACs,
        #   x 2 FLOPs x 36 layers = 13,891,534,848.
        # LM head: 2·h·V = 1,244,659,712.
        # Attention per token: 2 matmuls x 2 FLOPs x S x q = 4·4096·4096 = 67,108,864 per
        #   layer (Σlen²/S = S), x 36 = 2,415,919,104.
        # Forward = 13,891,534,848 + 1,244,659,712 + 2,415,919,104 = 17,552,113,664.
        # Full fine-tune: every matmul has dW and dx in backward -> x 3 = 52,656,340,992.
        ("qwen3-vl-8b", 17_552_113_664, 52_656_340_992),
        # Qwen3-VL-30B-A3B, same row. h = 2048, L = 48, q = 32·128 = 4096, kv = 4·128 = 512,
        # 128 experts, top-8, expert I = 768, V = 151936, every layer sparse.
        # Linear MACs per token and layer: q and o 2·h·q = 16,777,216; k, v 2·h·kv =
        #   2,097,152; router h·128 = 262,144; 8 routed experts x 3·h·768 = 37,748,736
        #   -> 56,885,248 MACs, x 2 x 48 layers = 5,460,983,808.
        # LM head: 2·h·V = 622,329,856.
        # Attention: 4·4096·4096 = 67,108,864 per layer, x 48 = 3,221,225,472.
        # Forward = 5,460,983,808 + 622,329,856 + 3,221,225,472 = 9,304,539,136; x 3 =
        #   27,913,617,408.
        ("qwen3-vl-30b-a3b", 9_304_539_136, 27_913_617_408),
    ],
)
def test_real_config_flops_per_token_at_4096_match_hand_derivation(
    name, forward_per_token, train_per_token
):
    config = real_config(name)
    pack = PackShape(seq_lens=(4096,), padded_len=4096, loss_tokens=4096)
    forward_only = step_flops(config, pack, mode="full", include_backward=False)
    train = step_flops(config, pack, mode="full")
    assert forward_only.total == 4096 * forward_per_token
    assert train.total == 4096 * train_per_token
    assert train.vision.total == 0  # text only


def test_lora_backward_skips_frozen_matmuls_before_first_adapter():
    config = real_config("qwen3-vl-8b")
    pack = PackShape(seq_lens=(4096,), padded_len=4096, loss_tokens=4096)
    lora = step_flops(config, pack, mode="lora", lora_rank=16)
    # Frozen base: backward is dx only (1x forward), except layer 0's q/k/v, whose input (the
    # frozen embedding) needs no grad: 2 · 4096 tokens · 4096 · (4096 + 2·1024) MACs.
    layer0_qkv = 2 * 4096 * 4096 * (4096 + 2 * 1024)
    assert lora.lm_dense.backward == lora.lm_dense.forward - layer0_qkv
    assert lora.lm_head.backward == lora.lm_head.forward
    assert lora.lm_attention.backward == 2 * lora.lm_attention.forward
    # Adapters over 4096 tokens, r = 16: forward 2·4096·16·Σ(d_in + d_out) over the 7
    # targets x 36 layers; Σ(d_in + d_out) per layer = (4096+4096)·2 + (4096+1024)·2 +
    # (4096+12288)·3 = 75,776. Backward is 2x, except layer 0's A on q/k/v (no dx):
    # 2·4096·16·4096 x 3 less.
    adapters_forward = 2 * 4096 * 16 * 75_776 * 36
    assert lora.lora_adapters.forward == adapters_forward
    assert lora.lora_adapters.backward == 2 * adapters_forward - 3 * 2 * 4096 * 16 * 4096


def test_nominal_flops_exceed_exact_when_row_has_padding():
    config = real_config("qwen3-vl-8b")
    pack = PackShape(
        seq_lens=(1500, 1200, 900),
        image_grids=((1, 32, 32), (1, 16, 24)),  # 256 + 96 visual tokens
        padded_len=4096,
        loss_tokens=1800,
    )
    nominal = nominal_flops(config, pack.padded_len)
    assert nominal == 6 * 8_190_735_360 * 4096 == 201_295_512_207_360
    full = step_flops(config, pack, mode="full")
    lora = step_flops(config, pack, mode="lora", lora_rank=16)
    assert nominal > full.total > lora.total
    # 3,600 real tokens of 4,096, and the embedding lookup is free: exact is 87% of nominal
    # for full fine-tuning (vision and attention included), 59% for LoRA.
    assert full.total / nominal == pytest.approx(0.873, abs=0.001)
    assert lora.total / nominal == pytest.approx(0.592, abs=0.001)


def test_lm_num_params_match_hf_models(processor):
    for moe in (False, True):
        model = build_tiny_model(processor, moe=moe)
        language = model.model.language_model
        expected = sum(p.numel() for p in language.parameters()) + model.lm_head.weight.numel()
        assert lm_num_params(model.config) == expected
    for name in QWEN3_VL_CONFIGS:
        config = real_config(name)
        cls = (
            Qwen3VLMoeForConditionalGeneration
            if name.endswith("a3b")
            else Qwen3VLForConditionalGeneration
        )
        with torch.device("meta"):
            model = cls(config)
        language = model.model.language_model
        tied = model.lm_head.weight is language.embed_tokens.weight
        expected = sum(p.numel() for p in language.parameters())
        expected += 0 if tied else model.lm_head.weight.numel()
        assert (lm_num_params(config), tied) == (expected, config.tie_word_embeddings)


@pytest.mark.parametrize(
    ("name", "lm_params"),
    [
        ("qwen3-vl-2b", 1_720_574_976),
        ("qwen3-vl-4b", 4_022_468_096),
        ("qwen3-vl-8b", 8_190_735_360),  # + 576,388,336 ViT = 8.77B, as published
        ("qwen3-vl-30b-a3b", 30_532_122_624),
    ],
)
def test_real_config_gives_published_model_sizes(name, lm_params):
    config = real_config(name)
    assert lm_num_params(config) == lm_params
    assert config.vision_config.patch_size == 16
    assert config.vision_config.temporal_patch_size == 2
    assert config.vision_config.spatial_merge_size == 2
    assert config.text_config.head_dim == 128


def test_real_config_rejects_unknown_name():
    with pytest.raises(ValueError, match="qwen3-vl-8b"):
        real_config("qwen3-vl-7b")


def test_mfu_uses_dense_bf16_datasheet_peak_for_known_gpus():
    assert PEAK_BF16_DENSE_TFLOPS == {"H100": 989.4, "H200": 989.4, "B200": 2250.0}
    assert mfu(494.7e12, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert mfu(989.4e12 * 0.4, "NVIDIA H200") == pytest.approx(0.4)
    assert mfu(900e12, "NVIDIA B200") == pytest.approx(0.4)


def test_mfu_is_none_when_device_has_no_datasheet_peak():
    assert mfu(1e12, "cpu") is None
    assert mfu(1e12, "NVIDIA H100 PCIe") is None  # lower clocks than the SXM figure
    assert mfu(1e12, "NVIDIA A10G") is None


def test_step_flops_rejects_invalid_input():
    config = real_config("qwen3-vl-2b")
    pack = PackShape(seq_lens=(10,), padded_len=16, loss_tokens=5)
    with pytest.raises(ValueError, match="lora_rank > 0"):
        step_flops(config, pack, mode="lora")
    with pytest.raises(ValueError, match="unknown LoRA target"):
        step_flops(config, pack, mode="lora", lora_rank=8, lora_targets=["qkv"])
    with pytest.raises(ValueError, match="mode must be"):
        step_flops(config, pack, mode="qlora")
    with pytest.raises(ValueError, match="need 25 LLM tokens"):
        images = PackShape(seq_lens=(10,), image_grids=((1, 10, 10),), padded_len=16, loss_tokens=1)
        step_flops(config, images, mode="full")
    with pytest.raises(ValueError, match="images and videos need 50 LLM tokens"):
        videos = PackShape(seq_lens=(49,), video_grids=((2, 10, 10),), padded_len=49, loss_tokens=1)
        step_flops(config, videos, mode="full")
    with pytest.raises(ValueError, match="video grid .* spatial_merge_size=2"):
        odd = PackShape(seq_lens=(99,), video_grids=((2, 3, 4),), padded_len=99, loss_tokens=1)
        step_flops(config, odd, mode="full")
    with pytest.raises(ValueError, match="a video grid is three positive ints"):
        PackShape(seq_lens=(10,), video_grids=((0, 2, 2),), padded_len=16, loss_tokens=1)
    with pytest.raises(ValueError, match="padded_len"):
        PackShape(seq_lens=(10, 10), padded_len=16, loss_tokens=5)
    with pytest.raises(ValueError, match="seq_lens"):
        PackShape(seq_lens=(), padded_len=16, loss_tokens=0)
