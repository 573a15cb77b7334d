"""Exact (real processor) and cheap (header sizes only) token counts agree."""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
from PIL import Image

from packline.qwen.lengths import LengthRecord, assistant_mask, cheap_lengths, exact_lengths
from packline.qwen.processor import copy_tiny_processor, load_processor
from packline.qwen.vision import ImageGeometry, read_image_size

# (width, height) -> visual tokens under the tiny geometry (factor 32, 4,096..1,048,576 px)
IMAGE_SIZES = {
    (300, 200): 54,
    (128, 128): 16,
    (40, 30): 6,  # upscaled to the minimum pixels
    (1400, 1000): 999,  # downscaled to the maximum pixels
    (1000, 1000): 961,
    (640, 480): 300,
    (17, 900): 28,  # thin: 32 x 896
    (2000, 100): 186,  # 1984 x 96: round(2000 / 32) = round(62.5) = 62, half to even
}
QUESTIONS = [
    "How many red circles are there?",
    "What colour is the star at the top left?",
    "Where is the green hexagon?",
    "Describe the image.",
    "Which image has more triangles?",
    "Ünïcödé? 🙂\nTwo lines.",
]
ANSWERS = [
    "Three.",
    "The star at the top left is blue.",
    "It is in the bottom right.",
    "\n\nThe image shows two yellow squares and one purple triangle.",  # leading newlines
    "<think>\ncount them\n</think>\n\nThe second image.",
    "",  # an empty reply still trains on its <|im_end|>
    "Four grey rectangles.  ",
]


def _case(index: int) -> tuple[list[dict], list[tuple[int, int]]]:
    """A deterministic conversation with ``index % 4`` images in its user turns."""
    rng = random.Random(index)
    sizes = [rng.choice(list(IMAGE_SIZES)) for _ in range(index % 4)]
    conversation: list[dict] = []
    if rng.random() < 0.5:
        prompt = "You are a helpful assistant."
        content = prompt if rng.random() < 0.5 else [{"type": "text", "text": prompt}]
        conversation.append({"role": "system", "content": content})
    num_turns = rng.randint(1, 3)
    remaining = len(sizes)
    for turn in range(num_turns):
        num_here = remaining if turn == num_turns - 1 else rng.randint(0, remaining)
        remaining -= num_here
        question = rng.choice(QUESTIONS)
        if num_here == 0 and rng.random() < 0.5:
            content = question
        else:
            content = [{"type": "image"} for _ in range(num_here)]
            content.insert(rng.randint(0, num_here), {"type": "text", "text": question})
        conversation.append({"role": "user", "content": content})
        answer = rng.choice(ANSWERS)
        if rng.random() < 0.5:
            conversation.append({"role": "assistant", "content": answer})
        else:
            conversation.append(
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}
            )
    return conversation, sizes


CASES = [_case(index) for index in range(20)]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(copy_tiny_processor(tmp_path_factory.mktemp("tiny") / "processor"))


def _encoded(size: tuple[int, int], index: int) -> bytes:
    image = Image.new("RGB", size, ((index * 70) % 256, 120, 200))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_cases_cover_images_turns_system_prompts_and_string_content():
    num_images = [len(sizes) for _, sizes in CASES]
    assert set(num_images) == {0, 1, 2, 3}
    assert any(size == (1400, 1000) for _, sizes in CASES for size in sizes)
    assert sum(1 for conversation, _ in CASES if conversation[0]["role"] == "system") >= 5
    assert any(len(conversation) >= 5 for conversation, _ in CASES)
    assert any(
        isinstance(message["content"], str) for conversation, _ in CASES for message in conversation
    )


@pytest.mark.parametrize("index", range(len(CASES)))
def test_exact_equals_cheap(processor, index):
    conversation, sizes = CASES[index]
    encoded = [_encoded(size, i) for i, size in enumerate(sizes)]
    images = [Image.open(io.BytesIO(data)) for data in encoded]
    exact = exact_lengths(processor, conversation, images)
    cheap = cheap_lengths(processor, conversation, [read_image_size(data) for data in encoded])
    assert exact == cheap
    assert exact.num_images == len(sizes)
    assert exact.image_tokens == sum(IMAGE_SIZES[size] for size in sizes)
    assert exact.total_tokens == exact.text_tokens + exact.image_tokens
    num_replies = sum(1 for message in conversation if message["role"] == "assistant")
    assert exact.loss_tokens >= num_replies  # at least each reply's <|im_end|>


def test_lengths_do_not_change_the_conversation(processor):
    conversation, sizes = CASES[3]
    before = copy.deepcopy(conversation)
    images = [Image.new("RGB", size) for size in sizes]
    first = exact_lengths(processor, conversation, images)
    assert exact_lengths(processor, conversation, images) == first
    assert cheap_lengths(processor, conversation, sizes) == first
    assert conversation == before


def test_a_wrong_visual_token_rule_gives_a_different_count(processor):
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
        {"role": "assistant", "content": "A red square."},
    ]
    exact = exact_lengths(processor, conversation, [Image.new("RGB", (300, 200))])
    # Qwen2-VL's patch size 14 (factor 28): 200 x 300 -> 196 x 308 -> grid 14 x 22 -> 77
    wrong = cheap_lengths(
        processor,
        conversation,
        [(300, 200)],
        visual_tokens=ImageGeometry(patch_size=14).visual_tokens,
    )
    assert exact.image_tokens == 54
    assert wrong.image_tokens == 77
    assert wrong.total_tokens - exact.total_tokens == 77 - 54
    assert wrong != exact


def test_loss_tokens_of_a_two_turn_conversation_counted_by_hand(processor):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "How many red circles?"}],
        },
        {"role": "assistant", "content": "Three."},
        {"role": "user", "content": "And blue squares?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Two blue squares."}]},
    ]
    tokenizer = processor.tokenizer
    assert tokenizer.tokenize("Three.") == ["Three", "."]
    assert tokenizer.tokenize("Two blue squares.") == ["Two", "Ġblue", "Ġsquares", "."]
    # (2 + <|im_end|>) + (4 + <|im_end|>)
    expected_loss = 3 + 5

    image = Image.new("RGB", (128, 128))
    exact = exact_lengths(processor, conversation, [image])
    cheap = cheap_lengths(processor, conversation, [(128, 128)])
    assert exact.loss_tokens == cheap.loss_tokens == expected_loss

    bound = copy.deepcopy(conversation)
    bound[1]["content"][0]["image"] = image
    out = processor.apply_chat_template(
        bound, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = [t for t, m in zip(out["input_ids"][0], out["assistant_masks"][0], strict=True) if m]
    assert tokenizer.decode(trained) == "Three.<|im_end|>Two blue squares.<|im_end|>"


def test_counts_of_a_text_only_conversation(processor):
    conversation = [
        {"role": "user", "content": "Describe the image."},
        {"role": "assistant", "content": "Three."},
    ]
    assert processor.tokenizer.tokenize("Describe the image.") == [
        "Describe",
        "Ġthe",
        "Ġimage",
        ".",
    ]
    # <|im_start|> user \n Describe the image . <|im_end|> \n: 9 tokens
    # <|im_start|> assistant \n Three . <|im_end|> \n: 7 tokens, of which "Three . <|im_end|>"
    # are trained on
    expected = LengthRecord(
        text_tokens=16, image_tokens=0, num_images=0, total_tokens=16, loss_tokens=3
    )
    assert exact_lengths(processor, conversation, []) == expected
    assert cheap_lengths(processor, conversation, []) == expected


def test_lengths_reject_images_that_do_not_match_the_image_parts(processor):
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    with pytest.raises(ValueError, match="2 image parts but 1 images"):
        exact_lengths(processor, conversation, [Image.new("RGB", (64, 64))])
    with pytest.raises(ValueError, match="2 image parts but 3 images"):
        cheap_lengths(processor, conversation, [(64, 64)] * 3)


def test_lengths_reject_an_image_in_an_assistant_reply(processor):
    conversation = [{"role": "assistant", "content": [{"type": "image"}]}]
    with pytest.raises(ValueError, match="assistant message holds image parts"):
        cheap_lengths(processor, conversation, [(64, 64)])


def test_cheap_lengths_rejects_an_image_pad_written_as_text(processor):
    conversation = [{"role": "user", "content": "<|image_pad|> sneaks in"}]
    with pytest.raises(ValueError, match="renders 1 image and 0 video placeholders for 0 images"):
        cheap_lengths(processor, conversation, [])


def test_loss_tokens_do_not_depend_on_generation_markers(processor):
    """A real Qwen3-VL template has no {% generation %} block: the count is the same."""
    plain = copy.copy(processor)
    plain.chat_template = processor.chat_template.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    assert "endgeneration" not in plain.chat_template
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And the shape?"},
        {"role": "assistant", "content": "\n\na circle, at the top left"},
    ]
    sizes = [(300, 200)]
    images = [Image.new("RGB", sizes[0])]
    marked = exact_lengths(processor, conversation, images)
    assert exact_lengths(plain, conversation, images) == marked
    assert cheap_lengths(plain, conversation, sizes) == marked


def test_assistant_mask_agrees_with_hf_generation_mask(processor):
    """Where the template has {% generation %} markers, HF's own mask gives the same count."""
    conversation = [
        {"role": "user", "content": "How many sides has a hexagon?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "Describe it."},
        {"role": "assistant", "content": "A hexagon has six equal sides."},
    ]
    out = processor.tokenizer.apply_chat_template(
        conversation,
        chat_template=processor.chat_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ours = assistant_mask(np.asarray(out["input_ids"]), processor.tokenizer)
    assert ours.tolist() == [bool(m) for m in out["assistant_masks"]]
