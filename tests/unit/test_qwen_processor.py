"""The built-in tiny Qwen3-VL processor and ``load_processor``: offline, no torchvision."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from packline.qwen.processor import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    PacklineQwen3VLProcessor,
    build_tiny_processor,
    load_processor,
    processor_geometry,
    special_token_ids,
)
from packline.qwen.vision import ImageGeometry

# What a real Qwen3-VL HF dir holds in preprocessor_config.json (Qwen/Qwen3-VL-8B-Instruct):
# it names the torchvision-backed image processor.
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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_processor(tmp_path_factory.mktemp("tiny") / "processor")


@pytest.fixture(scope="module")
def processor(tiny_dir) -> PacklineQwen3VLProcessor:
    return load_processor(tiny_dir)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_byte_identical_when_built_twice(tiny_dir, tmp_path):
    again = build_tiny_processor(tmp_path / "again")
    names = sorted(path.name for path in tiny_dir.iterdir())
    assert names == [
        "chat_template.jinja",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(path.name for path in again.iterdir()) == names
    assert _sha256(again / "tokenizer.json") == _sha256(tiny_dir / "tokenizer.json")
    for name in names:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


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


def test_load_processor_round_trips_a_saved_processor(processor, tmp_path):
    processor.save_pretrained(tmp_path / "resaved")
    again = load_processor(tmp_path / "resaved")
    assert isinstance(again, PacklineQwen3VLProcessor)
    assert isinstance(again.image_processor, Qwen2VLImageProcessorPil)
    assert again.video_processor is None
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


def test_load_processor_reads_a_hf_dir_naming_the_torchvision_image_processor(tiny_dir, tmp_path):
    hf_dir = tmp_path / "qwen3-vl-like"
    hf_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, hf_dir / name)
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(REAL_PREPROCESSOR_CONFIG))
    (hf_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))

    processor = load_processor(hf_dir)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessorPil)
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor_geometry(processor) == ImageGeometry(min_pixels=65536, max_pixels=16777216)
    # 300 x 200 rounds to 55,296 px < 65,536 -> beta = sqrt(65536 / 60000) = 1.0451,
    # h ceil(200 * 1.0451 / 32) = 7 -> 224, w ceil(300 * 1.0451 / 32) = 10 -> 320.
    out = processor.image_processor([Image.new("RGB", (300, 200))], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 14, 20]]


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


def test_processor_works_without_torchvision(processor):
    assert importlib.util.find_spec("torchvision") is None
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 64))}]},
        {"role": "assistant", "content": "A black square."},
    ]
    out = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert "torchvision" not in sys.modules
