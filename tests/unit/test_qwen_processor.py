"""The built-in tiny Qwen3-VL processor and ``load_processor``: offline, standard HF dirs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from packline.cache import CACHE_DIR_ENV
from packline.qwen.processor import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tiny_processor,
    copy_tiny_processor,
    load_processor,
    processor_geometry,
    special_token_ids,
)
from packline.qwen.vision import ImageGeometry
from packline.shapes.generate import (
    BACKGROUND_NAMES,
    COLOUR_NAMES,
    NUMBER_WORDS,
    ORDINALS,
    POSITION_NAMES,
    SHAPE_NAMES,
    SIZE_WORDS,
)

# sha256 of the tiny tokenizer.json since its corpus takes the shapes set's words, the video
# questions' included, from packline.shapes.generate (layout 4): every token id, so every length
# and loss, depends on it.
TINY_TOKENIZER_SHA256 = "e1480c9598e9d653edcec5fc29c1a51cae50f0822db0734f3611b1960e6c8349"

# What a real Qwen3-VL HF dir holds in preprocessor_config.json (Qwen/Qwen3-VL-8B-Instruct):
# it names the torchvision image processor by its legacy name.
REAL_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

# ... and in video_preprocessor_config.json. Its pixel bounds are the checkpoint's, not the
# Qwen3VLVideoProcessor class defaults (shortest_edge 131072, longest_edge 786432).
REAL_VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}

TINY_DIR_FILES = [
    "chat_template.jinja",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "video_preprocessor_config.json",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_processor(tmp_path_factory.mktemp("tiny") / "processor")


@pytest.fixture(scope="module")
def processor(tiny_dir) -> Qwen3VLProcessor:
    return load_processor(tiny_dir)


def _checkpoint_like_dir(tiny_dir: Path, out: Path, *, video: bool = True) -> Path:
    """A dir laid out like a downloaded Qwen3-VL checkpoint's processor files (with the tiny
    tokenizer): real image (and video) configs, the legacy chat_template.json."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    (out / "preprocessor_config.json").write_text(json.dumps(REAL_PREPROCESSOR_CONFIG))
    if video:
        config = json.dumps(REAL_VIDEO_PREPROCESSOR_CONFIG)
        (out / "video_preprocessor_config.json").write_text(config)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_byte_identical_when_built_twice(tiny_dir, tmp_path):
    again = build_tiny_processor(tmp_path / "again")
    assert sorted(path.name for path in tiny_dir.iterdir()) == TINY_DIR_FILES
    assert sorted(path.name for path in again.iterdir()) == TINY_DIR_FILES
    for name in TINY_DIR_FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert _sha256(tiny_dir / "tokenizer.json") == TINY_TOKENIZER_SHA256


def test_copy_from_the_cache_is_a_fresh_build_byte_for_byte(tiny_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    first = copy_tiny_processor(tmp_path / "first")  # a miss: builds the cache entry
    (entry,) = (cache / "tiny-processor").iterdir()  # one entry, no temp dir left behind
    built_at = {path.name: path.stat().st_mtime_ns for path in entry.iterdir()}
    second = copy_tiny_processor(tmp_path / "second")  # a hit: copies the entry
    assert [path.name for path in (cache / "tiny-processor").iterdir()] == [entry.name]
    assert {path.name: path.stat().st_mtime_ns for path in entry.iterdir()} == built_at
    for copy in (first, second):
        assert sorted(path.name for path in copy.iterdir()) == TINY_DIR_FILES
        for name in TINY_DIR_FILES:
            assert (copy / name).read_bytes() == (tiny_dir / name).read_bytes(), name
        assert copy.stat().st_mode == tiny_dir.stat().st_mode  # not the temp dir's 0700


def test_every_word_the_shapes_set_names_things_with_is_one_token(processor):
    names = (*COLOUR_NAMES, *BACKGROUND_NAMES, *SHAPE_NAMES, *POSITION_NAMES, *NUMBER_WORDS)
    words = sorted({word for name in (*names, *SIZE_WORDS, *ORDINALS) for word in name.split()})
    encode = processor.tokenizer.encode
    split = {w: encode(f" {w}", add_special_tokens=False) for w in words}
    assert {w: ids for w, ids in split.items() if len(ids) != 1} == {}


def test_tiny_dir_is_laid_out_like_a_qwen3_vl_checkpoint(tiny_dir):
    image = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    video = json.loads((tiny_dir / "video_preprocessor_config.json").read_text())
    tokenizer = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert image["image_processor_type"] == "Qwen2VLImageProcessor"  # the torchvision one
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert tokenizer["processor_class"] == "Qwen3VLProcessor"
    for config in (image, video):
        sizes = [config[key] for key in ("patch_size", "merge_size", "temporal_patch_size")]
        assert sizes == [16, 2, 2]
        assert config["size"] == {"shortest_edge": 4096, "longest_edge": 1048576}
        assert config["image_mean"] == config["image_std"] == [0.5, 0.5, 0.5]
    assert (tiny_dir / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert ImageGeometry.from_processor_dir(tiny_dir) == ImageGeometry()


def test_auto_processor_loads_the_tiny_dir_as_a_qwen3_vl_processor(tiny_dir):
    processor = AutoProcessor.from_pretrained(tiny_dir, local_files_only=True)
    assert type(processor) is Qwen3VLProcessor
    assert type(processor.image_processor) is Qwen2VLImageProcessor
    assert type(processor.video_processor) is Qwen3VLVideoProcessor
    assert type(processor.tokenizer) is Qwen2Tokenizer
    assert len(processor.tokenizer) == 4096
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor_geometry(processor) == ImageGeometry()
    video = processor.video_processor
    assert (video.patch_size, video.merge_size, video.temporal_patch_size) == (16, 2, 2)
    assert (video.size["shortest_edge"], video.size["longest_edge"]) == (4096, 1048576)


def test_tiny_dir_loads_as_megatron_bridge_loads_it(tiny_dir, processor):
    # Bridge's Qwen-VL task encoder builder: AutoTokenizer plus Qwen3VLProcessor.from_pretrained.
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    bridge = Qwen3VLProcessor.from_pretrained(tiny_dir)
    assert type(bridge.image_processor) is Qwen2VLImageProcessor
    assert type(bridge.video_processor) is Qwen3VLVideoProcessor
    assert tokenizer.get_vocab() == bridge.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert bridge.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>") == 4090
    assert bridge.video_token_id == 4091
    assert processor_geometry(bridge) == processor_geometry(processor) == ImageGeometry()


def test_tokenizer_has_4096_ids_with_qwen_specials_on_top(processor):
    tokenizer = processor.tokenizer
    assert len(tokenizer) == 4096
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS + TAG_TOKENS)) == list(
        range(4078, 4096)
    )
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 4090
    assert processor.image_token_id == 4090
    assert special_token_ids(processor) == {
        "image_token_id": 4090,
        "video_token_id": 4091,
        "vision_start_token_id": 4087,
        "vision_end_token_id": 4088,
        "pad_token_id": 4078,  # <|endoftext|>
        "eos_token_id": 4080,  # <|im_end|>
    }


def test_tokenizer_knows_the_shapes_vocabulary(processor):
    tokens = processor.tokenizer.tokenize("How many purple hexagons are at the top left?")
    assert tokens == ["How", "Ġmany", "Ġpurple", "Ġhexagons", "Ġare", "Ġat", "Ġthe", "Ġtop"] + [
        "Ġleft",
        "?",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "What colour is the star in the middle center?",
        "  leading spaces,\ttabs\n\nand blank lines\r\n",
        "Ünïcödé 日本語 🙂 — naïve café",
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n",
        '<think>\nmaybe\n</think>\n\n<tool_call>{"a": 1}</tool_call>',
    ],
)
def test_decode_inverts_encode(processor, text):
    tokenizer = processor.tokenizer
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_load_processor_round_trips_a_processor_saved_by_save_pretrained(processor, tmp_path):
    # transformers 5's own layout: image and video configs nested in processor_config.json.
    processor.save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved" / "preprocessor_config.json").exists()
    again = load_processor(tmp_path / "resaved")
    assert type(again) is Qwen3VLProcessor
    assert type(again.image_processor) is Qwen2VLImageProcessor
    assert type(again.video_processor) is Qwen3VLVideoProcessor
    assert again.chat_template == CHAT_TEMPLATE
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert processor_geometry(again) == ImageGeometry()
    assert ImageGeometry.from_processor_dir(tmp_path / "resaved") == ImageGeometry()
    text = "Which image has more red triangles? The second one."
    assert again.tokenizer.encode(text) == processor.tokenizer.encode(text)


def test_chat_template_renders_qwen_vl_chatml(processor):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "How many stars?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Two."}]},
        {"role": "user", "content": "And circles?"},
    ]
    rendered = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many stars?<|im_end|>\n"
        "<|im_start|>assistant\nTwo.<|im_end|>\n"
        "<|im_start|>user\nAnd circles?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # String content and a single text part render the same.
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "And circles?"}]}]
    assert processor.apply_chat_template(as_parts) == processor.apply_chat_template(
        [conversation[-1]]
    )


def test_image_grids_and_pads_follow_the_geometry(processor):
    # smart_resize with factor 16 * 2 = 32, min 64*64 = 4,096 px, max 1024*32*32 = 1,048,576 px:
    # 300 wide x 200 high -> h round(200/32) = 6 -> 192, w round(300/32) = 9 -> 288;
    #   192 * 288 = 55,296 px is in bounds -> grid 12 x 18 patches -> 216 / 4 = 54 tokens.
    # 128 x 128 -> 128 x 128 -> grid 8 x 8 -> 64 / 4 = 16 tokens.
    images = [Image.new("RGB", (300, 200), (255, 0, 0)), Image.new("RGB", (128, 128), (0, 0, 255))]
    prompt = "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "Which image is red?"
    out = processor(text=[prompt], images=images, return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 12, 18], [1, 8, 8]]
    # 216 + 64 patches, each 3 channels x 2 frames x 16 x 16 pixels
    assert out["pixel_values"].shape == (280, 1536)
    assert int(np.count_nonzero(out["input_ids"][0] == 4090)) == 54 + 16
    geometry = processor_geometry(processor)
    assert [geometry.grid_thw(200, 300), geometry.grid_thw(128, 128)] == [(1, 12, 18), (1, 8, 8)]
    assert [geometry.visual_tokens(200, 300), geometry.visual_tokens(128, 128)] == [54, 16]


def test_tiny_and_huge_images_are_resized_into_the_pixel_bounds(processor):
    # 40 x 30: rounds to 32 x 32 = 1,024 px < 4,096 -> beta = sqrt(4096 / 1200) = 1.8475,
    #   h ceil(30 * 1.8475 / 32) = 2 -> 64, w ceil(40 * 1.8475 / 32) = 3 -> 96 -> grid 4 x 6.
    # 1400 x 1000: rounds to 992 x 1408 = 1,396,736 px > 1,048,576 -> beta = 1.1555,
    #   h floor(1000 / 1.1555 / 32) = 27 -> 864, w floor(1400 / 1.1555 / 32) = 37 -> 1184
    #   -> grid 54 x 74 = 3,996 patches -> 999 tokens.
    images = [Image.new("RGB", (40, 30)), Image.new("RGB", (1400, 1000))]
    out = processor.image_processor(images, return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6], [1, 54, 74]]
    geometry = processor_geometry(processor)
    assert [geometry.visual_tokens(30, 40), geometry.visual_tokens(1000, 1400)] == [6, 999]


def test_fast_and_pil_image_processors_give_the_same_grids_and_tokens(tiny_dir, processor):
    pil = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir, local_files_only=True)
    rng = np.random.default_rng(0)
    # Sides on the 32-px grid and in bounds (not resized), then rounded, up- and downscaled.
    sizes = [(128, 128), (64, 320), (200, 300), (30, 40), (1000, 1400), (517, 233)]
    for i, (h, w) in enumerate(sizes):
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        fast = processor.image_processor(images=[image], return_tensors="np")
        slow = pil(images=[image], return_tensors="np")
        assert fast["image_grid_thw"].tolist() == slow["image_grid_thw"].tolist(), (h, w)
        # Pixel values differ only where the two backends' bicubic resizes differ: not at
        # all without a resize, by about 0.005 of a 0-255 level on average with one.
        levels = np.abs(fast["pixel_values"] - slow["pixel_values"]) * 127.5
        assert levels.max() < (1e-3 if i < 2 else 3.0), (h, w)
        assert levels.mean() < (1e-3 if i < 2 else 0.05), (h, w)


def test_video_processor_gives_video_grids_and_timestamped_tokens(processor):
    # 4 frames of 96 x 64 px, 2 fps: in bounds (4 * 64 * 96 = 24,576 px) -> t 4 / 2 = 2,
    # 4 x 6 patches per frame -> 2 * 24 = 48 patches -> 2 groups of 24 / 4 = 6 tokens, each
    # after the group's mean timestamp ((0 + 0.5) / 2, (1 + 1.5) / 2 seconds).
    frames = np.stack([np.full((64, 96, 3), 40 * i, dtype=np.uint8) for i in range(4)])
    conversation = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    metadata = {"total_num_frames": 4, "fps": 2.0, "frames_indices": [0, 1, 2, 3]}
    out = processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="np")
    assert out["video_grid_thw"].tolist() == [[2, 4, 6]]
    # each patch: 3 channels x 2 frames x 16 x 16 pixels
    assert out["pixel_values_videos"].shape == (48, 1536)
    ids = out["input_ids"][0]
    assert int(np.count_nonzero(ids == special_token_ids(processor)["video_token_id"])) == 12
    group = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    assert processor.tokenizer.decode(ids) == (
        f"<|im_start|>user\n<|vision_start|><0.2 seconds>{group}<1.2 seconds>{group}"
        "<|vision_end|>What moves?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_load_processor_reads_a_downloaded_qwen3_vl_checkpoint_layout(tiny_dir, tmp_path):
    hf_dir = _checkpoint_like_dir(tiny_dir, tmp_path / "qwen3-vl-like")
    processor = load_processor(hf_dir)
    assert type(processor) is Qwen3VLProcessor
    assert type(processor.image_processor) is Qwen2VLImageProcessor  # "...Fast" -> torchvision
    assert type(processor.video_processor) is Qwen3VLVideoProcessor
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor_geometry(processor) == ImageGeometry(min_pixels=65536, max_pixels=16777216)
    assert ImageGeometry.from_processor_dir(hf_dir) == processor_geometry(processor)
    video = processor.video_processor
    assert (video.patch_size, video.merge_size, video.temporal_patch_size) == (16, 2, 2)
    assert (video.size["shortest_edge"], video.size["longest_edge"]) == (4096, 25165824)
    assert (video.fps, video.min_frames, video.max_frames) == (2, 4, 768)
    # 300 x 200 rounds to 55,296 px < 65,536 -> beta = sqrt(65536 / 60000) = 1.0451,
    # h ceil(200 * 1.0451 / 32) = 7 -> 224, w ceil(300 * 1.0451 / 32) = 10 -> 320.
    out = processor.image_processor([Image.new("RGB", (300, 200))], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 14, 20]]
    # ... and it loads as it would in Megatron-Bridge and through AutoProcessor.
    for loaded in (Qwen3VLProcessor.from_pretrained(hf_dir), AutoProcessor.from_pretrained(hf_dir)):
        assert type(loaded) is Qwen3VLProcessor
        assert type(loaded.video_processor) is Qwen3VLVideoProcessor


def test_load_processor_gives_the_pil_image_processor_where_the_dir_names_it(tiny_dir, tmp_path):
    hf_dir = _checkpoint_like_dir(tiny_dir, tmp_path / "pil")
    config = {**REAL_PREPROCESSOR_CONFIG, "image_processor_type": "Qwen2VLImageProcessorPil"}
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(config))
    processor = load_processor(hf_dir)
    assert type(processor.image_processor) is Qwen2VLImageProcessorPil
    assert processor_geometry(processor) == ImageGeometry(min_pixels=65536, max_pixels=16777216)


def test_load_processor_rejects_a_dir_without_a_video_processor_config(tiny_dir, tmp_path):
    # As Bridge's Qwen3VLProcessor.from_pretrained would: the error is not deferred to it.
    hf_dir = _checkpoint_like_dir(tiny_dir, tmp_path / "no-video", video=False)
    with pytest.raises(ValueError, match="does not load as a Qwen3VLProcessor"):
        load_processor(hf_dir)


def test_load_processor_rejects_the_old_builtin_layout(tiny_dir, processor, tmp_path):
    # packline's built-in dir before it was standard: a processor_config.json naming a
    # subclass transformers does not know, without a video processor.
    old = tmp_path / "old"
    processor.tokenizer.save_pretrained(old)
    image = {
        **processor.image_processor.to_dict(),
        "image_processor_type": "Qwen2VLImageProcessorPil",
    }
    config = {"image_processor": image, "processor_class": "PacklineQwen3VLProcessor"}
    (old / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rerunning connect"):
        load_processor(old)


def test_load_processor_rejects_a_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_processor(tmp_path / "nowhere")


def test_load_processor_rejects_a_dir_without_image_processor(tmp_path):
    with pytest.raises(ValueError, match="no image processor config"):
        load_processor(tmp_path)


def test_load_processor_rejects_a_non_qwen_image_processor(tiny_dir, tmp_path):
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(tiny_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    config = {**REAL_PREPROCESSOR_CONFIG, "image_processor_type": "CLIPImageProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a Qwen-VL processor.*CLIPImageProcessor"):
        load_processor(tmp_path)


def test_load_processor_rejects_a_tokenizer_without_vision_tokens(tmp_path):
    letters = "abcdefghijklmnopqrstuvwxyzĠĊ"
    Qwen2Tokenizer(vocab={c: i for i, c in enumerate(letters)}, merges=[]).save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(REAL_PREPROCESSOR_CONFIG))
    with pytest.raises(ValueError, match="lacks <\\|vision_start\\|>"):
        load_processor(tmp_path)


def test_configured_geometry_is_written_into_connects_processor_dir(tmp_path):
    """processor.* replaces the dir's geometry in connect's copy: the loaded processor (what
    connect, the local trainer and Bridge all load) resizes by it, images and videos alike."""
    from packline.qwen.processor import materialize_processor
    from tests.conftest import make_config

    cfg = make_config(tmp_path / "work", "processor.min_pixels=8192", "processor.max_pixels=65536")
    dest = materialize_processor(cfg, tmp_path / "out")
    loaded = load_processor(dest)
    assert processor_geometry(loaded) == ImageGeometry(min_pixels=8192, max_pixels=65536)
    image = loaded.image_processor
    assert (image.size["shortest_edge"], image.size["longest_edge"]) == (8192, 65536)
    # a 1024x768 image is capped at 65,536 pixels: 288x192 (55,296), 18x12 patches, where
    # the built-in dir's bounds (up to 1,048,576 pixels) keep it at 1024x768, 64x48 patches
    picture = [Image.new("RGB", (1024, 768))]
    assert image(images=picture, return_tensors="np")["image_grid_thw"].tolist() == [[1, 12, 18]]
    default = load_processor(materialize_processor(make_config(tmp_path / "w0"), tmp_path / "o0"))
    grid = default.image_processor(images=picture, return_tensors="np")["image_grid_thw"]
    assert grid.tolist() == [[1, 48, 64]]
    # the video processor keeps its own (per clip) bounds; the patch sizes follow the config
    patched = materialize_processor(
        make_config(tmp_path / "work2", "processor.patch_size=14"), tmp_path / "out2"
    )
    again = load_processor(patched)
    assert again.image_processor.patch_size == again.video_processor.patch_size == 14
    assert again.video_processor.size == load_processor(dest).video_processor.size
