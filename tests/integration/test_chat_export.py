"""``packline chat`` and ``packline export`` on a real prepared set and a real PEFT adapter.

The adapter is made without training: the config's LoRA on the shipped tiny base, its B
factors set to small seeded random values (so the adapter changes the logits), saved where
the train stage saves it (:func:`packline.catalog.adapter_dir`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packline.catalog import adapter_dir
from packline.qwen.generate import model_inputs, sample_prompt
from packline.serving.chat import load_base, load_tuned, read_sample
from packline.train.setup import apply_lora
from pipelines.cli import main
from stages.connect import connect
from stages.prepare import prepare
from tests.conftest import make_config, png_bytes

SET = ("data.num_train=16", "data.num_val=4", "connect.num_workers=0")


def _args(work: Path) -> list[str]:
    return [f"work_dir={work}", *SET]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A prepared and connected set and an adapter where the packed run saves one."""
    work = tmp_path_factory.mktemp("chat") / "work"
    cfg = make_config(work, *SET)
    prepare(cfg)
    connect(cfg)
    model, _ = load_base(cfg)
    torch.manual_seed(cfg.train.seed)
    peft = apply_lora(model, cfg.lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    peft.save_pretrained(adapter_dir(cfg), save_embedding_layers=False)
    return work


#: Loads the merged export with transformers alone (no packline import), runs it on a
#: conversation and an image, and saves the inputs and the logits.
PLAIN_FORWARD = """
import json, sys
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

export, request, out = sys.argv[1:]
req = json.load(open(request))
processor = AutoProcessor.from_pretrained(export)
model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32).eval()
text = processor.apply_chat_template(req["conversation"], tokenize=False,
                                     add_generation_prompt=True)
images = [Image.open(p).convert("RGB") for p in req["images"]] or None
inputs = processor(text=[text], images=images, return_tensors="pt")
inputs.pop("token_type_ids", None)
with torch.no_grad():
    logits = model(**inputs).logits
assert not any(m.split(".")[0] == "packline" for m in sys.modules), "packline was imported"
torch.save({"inputs": dict(inputs), "logits": logits}, out)
"""


def test_export_merge_loads_with_plain_transformers_same_logits(work, tmp_path):
    """fp32: the merged checkpoint's logits on a val sample equal base + adapter (≤ 1e-5)."""
    out = tmp_path / "merged"
    assert main(["export", *_args(work), "--to", str(out), "--merge"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "processor_config.json").is_file()
    assert not (out / "adapter_config.json").exists()
    cfg = make_config(work, *SET)
    prompt = sample_prompt(read_sample(cfg))
    assert prompt.images, "the first val sample of the built-in set shows an image"
    images = []
    for i, img in enumerate(prompt.images):
        images.append(str(tmp_path / f"img{i}.png"))
        img.save(images[-1])
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"conversation": prompt.conversation, "images": images}))
    result = tmp_path / "plain.pt"
    run = subprocess.run(
        [sys.executable, "-c", PLAIN_FORWARD, str(out), str(request), str(result)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    plain = torch.load(result)
    model, processor = load_tuned(cfg)
    ours = model_inputs(processor, prompt)
    for name in ("input_ids", "pixel_values", "image_grid_thw"):  # the exported processor
        assert torch.equal(plain["inputs"][name], ours[name]), name
    base, _ = load_base(cfg)
    with torch.no_grad():
        tuned = model(**ours).logits
        untuned = base(**ours).logits
    diff = (plain["logits"] - tuned).abs().max().item()
    print(f"merged vs base+adapter: max |Δlogit| = {diff:.3g}")
    assert diff <= 1e-5
    assert (tuned - untuned).abs().max().item() > 1e-2  # the adapter does change the logits


def test_export_adapter_round_trips_with_peft(work, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "adapter"
    assert main(["export", *_args(work), "--to", str(out)]) == 0
    cfg = make_config(work, *SET)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (adapter_dir(cfg) / name).read_bytes()
    base, _ = load_base(cfg)
    loaded = PeftModel.from_pretrained(base, str(out))
    saved = load_file(out / "adapter_model.safetensors")
    state = loaded.state_dict()
    for key, value in saved.items():
        ours = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        )
        assert torch.equal(state[ours], value), key
    # an earlier export is replaced (it is packline's), its stale files gone
    (out / "stale.txt").write_text("x")
    assert main(["export", *_args(work), "--to", str(out)]) == 0
    assert not (out / "stale.txt").exists()


def test_export_refuses_non_empty_dir_packline_did_not_make(work, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", *_args(work), "--to", str(mine), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "--to" in err and "not made by packline" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.glob(".tmp-export-*"))


def test_chat_sample_prints_answer_and_reference(work, capsys):
    cfg = make_config(work, *SET)
    sample = read_sample(cfg)
    reference = sample_prompt(sample).reference
    assert main(["chat", *_args(work), "--sample", sample.__key__, "--max-new-tokens=8"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["sample", "question", "answer", "reference"]
    assert lines[0].split()[-1] == sample.__key__
    assert lines[3] == f"reference: {reference}"
    assert "Traceback" not in err


def test_chat_prompt_with_an_image_answers(work, tmp_path, capsys):
    image = tmp_path / "disc.png"
    image.write_bytes(png_bytes((96, 64), "red"))
    args = [*_args(work), "--image", str(image), "What colour is the shape?"]
    assert main(["chat", *args, "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1, out  # the answer alone
    assert "Traceback" not in err


def test_chat_unknown_sample_key_exits_2(work, capsys):
    assert main(["chat", *_args(work), "--sample", "no-such-key"]) == 2
    assert "no such key" in capsys.readouterr().err


def test_chat_prompt_with_a_video_answers(work, tmp_path, capsys):
    import numpy as np

    from packline.media.video import write_video

    frames = np.zeros((8, 64, 96, 3), np.uint8)
    frames[:, 10:30, 20:50] = (255, 0, 0)
    video = write_video(tmp_path / "clip.mp4", frames, 4.0)
    args = [*_args(work), "--video", str(video), "What happens in the clip?"]
    assert main(["chat", *args, "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1, out
    assert "Traceback" not in err
