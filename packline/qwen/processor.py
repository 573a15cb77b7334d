"""The Qwen3-VL processor: the built-in tiny one, and loading any Qwen-VL processor dir.

Everything here works offline. The tiny processor is the stock ``transformers``
``Qwen3VLProcessor``: a byte-level BPE tokenizer trained on a small corpus generated in this
module, with Qwen's special tokens at the top ids; a Qwen-VL ChatML chat template; the
torchvision image processor ``Qwen2VLImageProcessor`` (transformers 5's name for what real
checkpoints call ``Qwen2VLImageProcessorFast``) with
:class:`~packline.qwen.vision.ImageGeometry`'s default geometry; and a
``Qwen3VLVideoProcessor`` with the same patch, merge and temporal patch sizes. Its dir is
laid out as a downloaded Qwen3-VL checkpoint's processor files are
(``preprocessor_config.json``, ``video_preprocessor_config.json``, ``tokenizer.json``,
``tokenizer_config.json``, plus ``chat_template.jinja``, where older downloads have
``chat_template.json``), so ``AutoProcessor.from_pretrained`` and Megatron-Bridge's
``Qwen3VLProcessor.from_pretrained`` load it as they load a real one. Built twice, every
file is byte-identical.

Training its tokenizer takes a second or so, so :func:`copy_tiny_processor` (what connect
calls) builds it once per set of inputs into a content-addressed cache
(``$PACKLINE_CACHE_DIR``, default ``~/.cache/packline``) and copies it from there: the
copy's files are the bytes a fresh :func:`build_tiny_processor` writes.

The model config must take its token ids from :func:`special_token_ids`: the tiny vocab has
4,096 ids, so the HF config defaults (``image_token_id=151655``, ...) would be wrong.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import tokenizers
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from packline.cache import cache_dir
from packline.qwen.vision import ImageGeometry, VideoGeometry
from packline.shapes.words import (
    BACKGROUND_NAMES,
    COLOUR_NAMES,
    DIRECTION_NAMES,
    NUMBER_WORDS,
    ORDINALS,
    POSITION_NAMES,
    SHAPE_NAMES,
    SIZE_WORDS,
)
from schemas.config import PipelineConfig
from schemas.errors import UserError

TINY_VOCAB_SIZE = 4096
"""Ids in the tiny tokenizer, special tokens included."""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen's control tokens in Qwen's id order (151643.. in the real vocab)."""

TAG_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
"""Added tokens that Qwen keeps as ordinary (non-special) text tokens, after the specials."""

# Qwen-VL ChatML. An image part becomes <|vision_start|><|image_pad|><|vision_end|> (the
# processor expands the pad to the image's token count); string content is written as is.
# The {% generation %} block spans each assistant reply and its <|im_end|>: that is what
# ``return_assistant_tokens_mask`` marks, and what packline trains on.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- else -%}
{%- for item in content -%}
{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif item.type == 'video' or 'video' in item -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in item -%}
{{- item.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- generation -%}
{{- render_content(message.content) + '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


# --- the built-in tiny processor -------------------------------------------------------

# The shapes set's own names (packline/shapes/generate.py), and words its phrasings use around them.
_SHAPES_WORDS = (
    *COLOUR_NAMES,
    *(word for name in BACKGROUND_NAMES for word in name.split()),
    *SHAPE_NAMES,
    *SIZE_WORDS,
    *ORDINALS,
    *DIRECTION_NAMES,
    *(
        "video clip moves move appears appear disappears first last turns turn changes start "
        "end beginning"
    ).split(),
    *(
        "tiny about pixels across centred near background sides side drawing poster box holds "
        "shows shape shapes Image Colours Shapes total together same number each most in all "
        "the images every detail size position"
    ).split(),
)
_COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light kind "
    "off need house picture try us again animal point mother world near build self earth father "
    "head stand own page should country found answer school grow study still learn plant cover "
    "food sun four between state keep eye never last let thought city tree cross farm hard "
    "start might story saw far sea draw left late run don't while press close night real life "
    "few north open seem together next white children begin got walk example ease paper group "
    "always music those both mark often letter until mile river car feet care second book "
    "carry took science eat room friend began idea fish mountain stop once base hear horse cut "
    "sure watch colour face wood main enough plain girl usual young ready above ever red list "
    "though feel talk bird soon body dog family direct pose leave song measure door product "
    "black short numeral class wind question happen complete ship area half rock order fire "
    "south problem piece told knew pass since top whole king space heard best hour better true "
    "during hundred five remember step early hold west ground interest reach fast verb sing "
    "listen six table travel less morning ten simple several vowel toward war lay against "
    "pattern slow center love person money serve appear road map rain rule govern pull cold "
    "notice voice unit power town fine certain fly fall lead cry dark machine note wait plan "
    "figure star box noun field rest correct able pound done beauty drive stood contain front "
    "teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force "
    "blue object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane stead dry wonder laugh thousand ago ran check game shape equate miss "
    "brought heat snow tire bring yes distant fill east paint language among image images"
).split()
_CHAT_WORDS = (
    "user assistant system You are a helpful assistant . Sure ! Here is the answer : "
    "Thanks , please look at this picture and tell me Yes No Okay I see"
).split()
_SYLLABLES = (
    "ba be bi bo bu ca ce ci co cu da de di do du fa fe fi fo ga ge go gu ha he hi ho ja jo "
    "ka ke ki ko la le li lo lu ma me mi mo mu na ne ni no nu pa pe pi po pu ra re ri ro ru "
    "sa se si so su ta te ti to tu va ve vi vo wa we wi yo za ze zo an en in on un ar er ir "
    "or ur al el il ol st str th ch sh ph tr pr gr br cr dr fl pl cl bl ing tion ment ness ed "
    "er est ly ous ive able ful less ism ist ity"
).split()
_SYSTEM_PROMPT = "You are a helpful assistant."
_PUNCTUATION = (".", ".", ".", ",", "?", "!", ";", ":", " -", "...")


def _shapes_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """Question/answer pairs in the vocabulary of the synthetic "shapes" dataset: its
    colours, backgrounds, shapes, grid positions, ordinals and number words."""
    n = rng.randrange(len(NUMBER_WORDS))
    colour, other = rng.sample(COLOUR_NAMES, 2)
    shape, other_shape = rng.sample(SHAPE_NAMES, 2)
    plural = shape + "s" if n != 1 else shape
    where = rng.choice(POSITION_NAMES)
    ordinal = rng.choice(ORDINALS)
    return [
        (f"How many {colour} {shape}s are there?", f"There are {NUMBER_WORDS[n]}: {n}."),
        (f"Count the {colour} {shape}s.", f"{NUMBER_WORDS[n].capitalize()} {colour} {plural}."),
        (f"What colour is the {shape} at the {where}?", f"The {shape} is {colour}."),
        (f"Where is the {other} {other_shape}?", f"It is in the {where} of the image."),
        (
            "Describe the image.",
            f"The image shows {NUMBER_WORDS[n]} {colour} {plural} and one {other} "
            f"{other_shape} on a {rng.choice(BACKGROUND_NAMES)} background.",
        ),
        (f"Which image has more {other_shape}s?", f"The {ordinal} image has more {other_shape}s."),
    ]


def _english_line(rng: random.Random, made_up: list[str]) -> str:
    """A sentence of common and made-up words with capitals, digits and punctuation."""
    words = [rng.choice(_COMMON_WORDS if rng.random() < 0.6 else made_up) for _ in range(12)]
    words[0] = words[0].capitalize()
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randrange(100000)))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(_CHAT_WORDS))
    return " ".join(words) + rng.choice(_PUNCTUATION)


def _tiny_corpus(num_lines: int = 30000, seed: int = 0) -> list[str]:
    """The deterministic training corpus of the tiny tokenizer: English-ish sentences (which
    give BPE enough distinct words to fill the vocab), the shapes dataset's questions and
    answers, and the same laid out as ChatML turns (without the special tokens)."""
    rng = random.Random(seed)
    made_up = sorted(
        {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(6000)}
    )
    lines = [" ".join(_CHAT_WORDS), " ".join(_COMMON_WORDS), "\n\n", "  \n\t  "]
    lines += [" ".join(rng.sample(_SHAPES_WORDS, 8)) for _ in range(200)]
    while len(lines) < num_lines:
        if rng.random() < 0.7:
            lines.append(_english_line(rng, made_up))
            continue
        for question, answer in _shapes_pairs(rng):
            if rng.random() < 0.5:
                lines.extend((question, answer))
            else:
                lines.append(f"system\n{_SYSTEM_PROMPT}\nuser\n{question}\nassistant\n{answer}\n")
    return lines[:num_lines]


def _train_bpe(corpus: list[str], num_merged_ids: int) -> tuple[dict[str, int], list[tuple]]:
    """Train a Qwen2-style byte-level BPE; returns its (vocab, merges)."""
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = BpeTrainer(
        vocab_size=num_merged_ids,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    assert len(vocab) == num_merged_ids, f"the corpus trained only {len(vocab)} ids: enlarge it"
    return vocab, [tuple(merge) for merge in model["merges"]]


def _build_tiny_tokenizer() -> Qwen2Tokenizer:
    """The tiny tokenizer: 4,078 trained byte-level BPE ids, then Qwen's 14 control tokens
    and 4 tag tokens at the top ids (4078..4095), in Qwen's order."""
    top = SPECIAL_TOKENS + TAG_TOKENS
    vocab, merges = _train_bpe(_tiny_corpus(), TINY_VOCAB_SIZE - len(top))
    vocab = {**vocab, **{token: TINY_VOCAB_SIZE - len(top) + i for i, token in enumerate(top)}}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(SPECIAL_TOKENS),
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tokenizer


def _tiny_media_kwargs() -> dict:
    """What the tiny image and video processors share: the default geometry's patch, merge
    and temporal patch sizes, normalisation and pixel bounds."""
    geometry = ImageGeometry()
    return {
        "patch_size": geometry.patch_size,
        "temporal_patch_size": geometry.temporal_patch_size,
        "merge_size": geometry.merge_size,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        # Images: each within [min_pixels, max_pixels]. Videos: a clip's sampled frames
        # together within the same bounds, so about 1,024 visual tokens at most.
        "size": {"shortest_edge": geometry.min_pixels, "longest_edge": geometry.max_pixels},
    }


def tiny_video_processor() -> Qwen3VLVideoProcessor:
    """The tiny processor's video processor (no tokenizer is built): the whole-clip budget
    without the reference per-frame cap, said explicitly (the processor warns when it is
    left unset); sampling at the class's defaults, 2 frames per second."""
    return Qwen3VLVideoProcessor(**_tiny_media_kwargs(), cap_pixels_per_frame=False)


def build_tiny_processor(out_dir: Path) -> Path:
    """Build the built-in tiny processor into ``out_dir`` (created) and return it.

    Offline and deterministic: the same inputs give byte-identical files. Load it back with
    :func:`load_processor` (or ``AutoProcessor`` / ``Qwen3VLProcessor.from_pretrained``).
    """
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**_tiny_media_kwargs()),
        tokenizer=_build_tiny_tokenizer(),
        video_processor=tiny_video_processor(),
        chat_template=CHAT_TEMPLATE,
    )
    return _save_like_a_checkpoint(processor, Path(out_dir))


@functools.cache  # its inputs are fixed once the modules are imported
def tiny_processor_key() -> str:
    """sha256 over everything :func:`build_tiny_processor`'s output depends on (no version to
    bump by hand: a change to any of them is a new key, so a new cache entry, and connect's
    fingerprint changes with it): the vocab size, the special and tag tokens, the chat
    template, the tokenizer's training corpus (so the word lists it is drawn from,
    :mod:`packline.shapes.words`), the image geometry, the builder's
    own source and the versions of ``tokenizers`` and ``transformers``."""
    parts = {
        "vocab_size": TINY_VOCAB_SIZE,
        "tokens": [*SPECIAL_TOKENS, *TAG_TOKENS],
        "chat_template": CHAT_TEMPLATE,
        "corpus": hashlib.sha256("\n".join(_tiny_corpus()).encode()).hexdigest(),
        "geometry": asdict(ImageGeometry()),
        "builder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def copy_tiny_processor(out_dir: Path) -> Path:
    """The built-in tiny processor in ``out_dir`` (created), byte-identical to
    :func:`build_tiny_processor` ``(out_dir)``: copied from ``<cache>/tiny-processor/<key>``
    (see :func:`tiny_processor_key`), which is built first when missing.

    The cache entry is built in a temp dir beside it and renamed into place, so a reader never
    sees a partial one; processes building at the same time each build, the first rename wins
    and the others use its entry. Delete the cache dir to rebuild.
    """
    root = cache_dir() / "tiny-processor"
    entry = root / tiny_processor_key()
    if not entry.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:
            # Built one level down: mkdtemp's dir is private (0700), the built dir is not.
            built = build_tiny_processor(tmp / "processor")
            try:
                os.rename(built, entry)
            except OSError:
                if not entry.is_dir():  # not another process's entry: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out_dir = Path(out_dir)
    shutil.copytree(entry, out_dir, copy_function=shutil.copy, dirs_exist_ok=True)
    return out_dir


def _save_like_a_checkpoint(processor: Qwen3VLProcessor, out_dir: Path) -> Path:
    """Save each part with its own ``save_pretrained``: the files a downloaded Qwen3-VL
    checkpoint has. (``Qwen3VLProcessor.save_pretrained`` in transformers 5 would nest the
    image and video configs in one ``processor_config.json`` instead.)"""
    out_dir.mkdir(parents=True, exist_ok=True)
    processor.image_processor.save_pretrained(out_dir)  # preprocessor_config.json
    processor.video_processor.save_pretrained(out_dir)  # video_preprocessor_config.json
    # tokenizer_config.json's processor_class is what AutoProcessor resolves the dir by.
    processor.tokenizer._set_processor_class(type(processor).__name__)
    processor.tokenizer.save_pretrained(out_dir)  # tokenizer.json, tokenizer_config.json
    (out_dir / "chat_template.jinja").write_text(processor.chat_template, encoding="utf-8")
    return out_dir


# --- loading and reading a processor ---------------------------------------------------

_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _tokenizer_chat_template(path: Path, tokenizer) -> str:
    """The tokenizer's own chat template, for dirs with no ``chat_template.jinja`` or
    ``chat_template.json`` (which the processor reads itself)."""
    if isinstance(tokenizer.chat_template, str) and tokenizer.chat_template:
        return tokenizer.chat_template
    raise ValueError(
        f"{path} has no chat template (chat_template.jinja, chat_template.json or "
        "tokenizer_config.json 'chat_template')"
    )


def load_processor(path: str | Path) -> Qwen3VLProcessor:
    """Load a Qwen-VL processor dir as a ``Qwen3VLProcessor``: the built-in tiny one, a
    downloaded Qwen3-VL checkpoint, or one saved by ``save_pretrained``.

    Loads it as Megatron-Bridge does (``Qwen3VLProcessor.from_pretrained``): the image
    processor the dir names (``Qwen2VLImageProcessor`` or the legacy name
    ``Qwen2VLImageProcessorFast``, as real checkpoints say: the torchvision one), its video
    processor, tokenizer and chat template. A dir naming ``Qwen2VLImageProcessorPil`` gets
    the PIL one (transformers' ``AutoImageProcessor`` would load the torchvision one
    regardless); both give the same grids and token counts. Raises ``ValueError`` if the dir
    is missing, does not hold a Qwen-VL processor, or has no loadable video processor.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"processor dir {path} does not exist")
    ImageGeometry.from_processor_dir(path)  # ValueError if there is no image processor config
    config_type = _image_processor_type(path)
    if config_type is not None and not config_type.startswith("Qwen2VLImageProcessor"):
        raise ValueError(
            f"{path} is not a Qwen-VL processor: its image processor is {config_type}, "
            "expected a Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} holds no loadable tokenizer: {exc}") from exc
    vocab = tokenizer.get_vocab()
    if missing := [token for token in _VISION_TOKENS if token not in vocab]:
        raise ValueError(
            f"{path} is not a Qwen-VL processor: its tokenizer lacks {', '.join(missing)}"
        )
    try:
        processor = Qwen3VLProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} does not load as a Qwen3VLProcessor, the way Megatron-Bridge loads it: "
            f"{exc} A Qwen3-VL processor dir holds preprocessor_config.json, "
            "video_preprocessor_config.json and the tokenizer files; a built-in one from an "
            "older packline is rebuilt by rerunning connect (--from connect)."
        ) from exc
    if config_type == "Qwen2VLImageProcessorPil":
        processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(
            path, local_files_only=True
        )
    if not processor.chat_template:
        processor.chat_template = _tokenizer_chat_template(path, processor.tokenizer)
    return processor


def _image_processor_type(path: Path) -> str | None:
    """The image processor class the dir's config names, if it names one."""
    for name, key in (
        ("preprocessor_config.json", None),
        ("processor_config.json", "image_processor"),
    ):
        if (file := path / name).is_file():
            params = json.loads(file.read_text())
            params = params.get(key) or {} if key else params
            if "image_processor_type" in params:
                return params["image_processor_type"]
    return None


def special_token_ids(processor: Qwen3VLProcessor) -> dict[str, int]:
    """The token ids the model config must take (``Qwen3VLConfig(**special_token_ids(p))``)."""
    tokenizer = processor.tokenizer
    ids = {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if missing := [name for name, value in ids.items() if value is None]:
        raise ValueError(f"the tokenizer has no {', '.join(missing)}")
    return ids


def processor_geometry(processor: Qwen3VLProcessor) -> ImageGeometry:
    """The image geometry (patch, merge, min/max pixels) of a loaded processor's image
    processor (torchvision or PIL: both keep ``size`` as ``shortest_edge``/``longest_edge``)."""
    image_processor = processor.image_processor
    size = image_processor.size
    return ImageGeometry(
        patch_size=int(image_processor.patch_size),
        merge_size=int(image_processor.merge_size),
        temporal_patch_size=int(image_processor.temporal_patch_size),
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
    )


def processor_video_geometry(processor: Qwen3VLProcessor) -> VideoGeometry:
    """The video geometry (frame sampling, whole-clip pixel bounds, patch sizes) of a loaded
    processor's video processor."""
    return VideoGeometry.of(processor.video_processor)


# --- the configured processor's geometry ---------------------------------------------------

#: Geometry fields of ``processor.*`` that a video processor takes too (the pixel bounds of a
#: video are the whole clip's, not an image's: connect writes them into the image config only).
VIDEO_GEOMETRY_FIELDS = ("patch_size", "temporal_patch_size", "merge_size")


def image_geometry(cfg: PipelineConfig) -> ImageGeometry:
    """The resize rule of the configured processor (the built-in tiny one by default), with
    the geometry fields the config sets (``processor.min_pixels`` ...) in place of the dir's."""
    if cfg.processor.path:
        geometry = ImageGeometry.from_processor_dir(cfg.processor.dir)
    else:
        geometry = ImageGeometry()
    return geometry.with_overrides(**cfg.processor.geometry_overrides())


def video_geometry(cfg: PipelineConfig) -> VideoGeometry:
    """The frame sampling and resize rule of the configured processor's video processor
    (``video_preprocessor_config.json``, or the ``video_processor`` entry of
    ``processor_config.json``; the video processor's defaults when the dir has neither), the
    built-in tiny one's by default, with the patch sizes the config sets."""
    if cfg.processor.path:
        path = cfg.processor.dir
        params: dict | None = None
        if (path / "video_preprocessor_config.json").is_file():
            params = json.loads((path / "video_preprocessor_config.json").read_text())
        elif (path / "processor_config.json").is_file():
            params = json.loads((path / "processor_config.json").read_text()).get("video_processor")
        geometry = VideoGeometry.from_config(params or {})
    else:
        geometry = _tiny_video_geometry()
    overrides = cfg.processor.geometry_overrides()
    return geometry.with_overrides(
        **{k: v for k, v in overrides.items() if k in VIDEO_GEOMETRY_FIELDS}
    )


def _tiny_video_geometry() -> VideoGeometry:
    """The built-in tiny processor's video geometry (its video processor alone: no tokenizer
    is built)."""
    return VideoGeometry.of(tiny_video_processor())


def processor_source(cfg: PipelineConfig) -> Path | None:
    """The user's processor dir (``processor.path``: a dir, or a Hub repo's cached
    snapshot), resolved; None for the tiny one. A repo the cache lacks is refused."""
    if cfg.processor.path and cfg.processor.dir is None:
        from schemas.hub import fetch_command

        raise UserError(
            [
                f"processor.path {cfg.processor.path} is not in the local Hugging Face cache; "
                f"fix: run `{fetch_command(cfg.processor.path)}`, or set model.download=true"
            ],
            "connect: no processor",
        )
    return cfg.processor.dir


def materialize_processor(cfg: PipelineConfig, dest: Path, *, for_bridge: bool = False) -> Path:
    """Write the processor dir ``dest``: a copy of the user's, or the tiny one,
    with the geometry the config sets (``processor.min_pixels`` ...) written into it, so that
    every later reader of the dir (connect itself, the local trainer, Bridge) resizes alike.

    ``for_bridge`` (the train backend renders as Bridge does: connect asks its spec) also
    gives its video processor ``do_sample_frames: false``: Bridge calls the processor
    without it (and without a frame rate), so the dir's value decides, and Qwen3-VL's own
    ``true`` would re-sample prepare's pre-sampled frames under an assumed 24 fps, keeping
    a few of them (4 of 12 at 2 fps). packline's own calls say ``do_sample_frames``
    explicitly, so the local path does not read it."""
    from packline.qwen.vision import set_processor_geometry, set_video_sampling

    src = processor_source(cfg)
    if src is None:
        copy_tiny_processor(dest)  # from the cache: the bytes a fresh build writes
    else:
        shutil.copytree(src, dest)
    if overrides := cfg.processor.geometry_overrides():
        set_processor_geometry(dest, **overrides)
    if for_bridge:
        set_video_sampling(dest, do_sample_frames=False)
    processor = load_processor(dest)  # fails here, with the loader's message
    loaded = processor_geometry(processor)
    wanted = image_geometry(cfg)
    if loaded != wanted:
        raise UserError(
            [f"{dest} resizes with {loaded}, the config asks for {wanted}"],
            "connect: the processor dir does not take the configured geometry",
        )
    if for_bridge and processor.video_processor.do_sample_frames:
        raise UserError(
            [f"{dest} still samples video frames (do_sample_frames) after connect set it off"],
            "connect: the processor dir does not take Megatron-Bridge's video settings",
        )
    return dest
