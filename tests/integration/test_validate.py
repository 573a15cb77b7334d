"""The validate stage on a real prepared + connected tiny dataset: one test per data and model
rule (the exact message, exit 2 for errors, exit 0 for warnings), all errors listed at once,
the report, and the train stage refusing to start without it. The SLURM and Megatron rules run
in the same pass: the shipped cluster configs, on the tiny set with tiny stand-ins for the
cluster's model and processor dirs, pass; each Bridge rule broken alone, and three at once, is
listed with exit 2."""

from __future__ import annotations

import json
import math
import shutil
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import LlamaConfig

from packline.packing.selection import align_up
from packline.qwen.encode import ConversationEncoder
from packline.qwen.model import tiny_config
from packline.qwen.processor import load_processor, special_token_ids
from packline.rules.data import buffered_bytes
from packline.rules.inputs import load_inputs
from packline.train.setup import build_model
from pipelines.cli import main
from schemas.config import PROJECT_ROOT
from schemas.errors import UserError
from stages.base import invalidate_from, read_record
from stages.connect import connect
from stages.prepare import prepare
from stages.runner import run_stage
from stages.train import train
from stages.validate import upstream, validate
from tests.conftest import make_config

DENSE = PROJECT_ROOT / "configs" / "qwen3_vl_8b_lora_1node.yaml"
MOE = PROJECT_ROOT / "configs" / "qwen3_vl_30b_a3b_lora_ep8_slurm.yaml"
BASE = ["data.num_train=60", "data.num_val=8", "prepare.num_workers=1", "mlflow.enabled=false"]
SAME_CHECKPOINT = (
    "use the processor and the model of the same checkpoint (processor.path, model.path)"
)


@pytest.fixture(scope="module")
def connected(tmp_path_factory) -> Path:
    """The default config's built-in set at 60 + 8 samples, prepared and connected once."""
    work = tmp_path_factory.mktemp("validate") / "work"
    cfg = make_config(work, "mlflow.enabled=false")
    prepare(cfg)
    connect(cfg)
    return work


@pytest.fixture(scope="module")
def lengths(connected) -> pd.DataFrame:
    return pd.read_parquet(connected / "connect" / "lengths.parquet")


def _validate(
    work: Path, capsys, *overrides: str, config: Path | None = None
) -> tuple[int, list[str], dict]:
    """``packline stage validate [config]`` in this process: exit code, the problems it
    listed on stderr, and the report it wrote."""
    shutil.rmtree(work / "validate", ignore_errors=True)
    config_arg = [str(config)] if config else []
    code = main(
        ["stage", "validate", *config_arg, f"work_dir={work}", *BASE, *overrides, "--force"]
    )
    err = capsys.readouterr().err
    problems = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    assert "Traceback" not in err
    report = json.loads((work / "validate" / "report.json").read_text())
    return code, problems, report


def _texts(report: dict, severity: str) -> list[str]:
    return [f"{f['message']}; fix: {f['fix']}" for f in report[f"{severity}s"]]


STALE = (
    "connect's outputs in {work}/connect were made under other settings (its completion record "
    "does not match this config); the data checks read them as they are; fix: rerun the stale "
    "stages: packline run (or packline stage connect)"
)


# --- the shipped config ----------------------------------------------------------------------


def test_default_config_passes_every_rule_and_train_requires_the_record(connected, capsys):
    code, problems, report = _validate(connected, capsys)
    assert code == 0 and problems == []
    assert report["ok"] and report["errors"] == [] and report["warnings"] == []
    status = {c["rule"]: c["status"] for c in report["checks"]}
    assert set(status.values()) <= {"ok", "not applicable"}
    for rule in (
        "config.packing",
        "packing.micro_batch",
        "data.tables",
        "data.overlength",
        "packing.forecast_fill",
        "packing.worker_memory",
        "model.token_ids",
        "model.vision_geometry",
        "lora.targets",
    ):
        assert status[rule] == "ok", rule
    assert status["megatron.mtp"] == "not applicable"  # local backend
    facts = report["facts"]
    assert facts["lora_targets"]["module:q_proj"] == 2  # one per layer of the tiny model
    assert (
        facts["token_ids"]["image_token_id"]["processor"]
        == facts["token_ids"]["image_token_id"]["model"]
    )
    assert (connected / "validate" / "pipeline.yaml").is_file()
    record = read_record(make_config(connected).work_path, "validate")
    assert record is not None and record["metrics"]["validate/errors"] == 0

    cfg = make_config(connected, "mlflow.enabled=false")
    invalidate_from(cfg.work_path, "validate")
    with pytest.raises(UserError) as info:
        train(cfg)
    assert info.value.header == "train cannot start"
    assert info.value.problems == [
        f"validate has not completed in {connected} (run `packline stage validate` first)"
    ]


def test_train_validates_changed_settings_before_it_starts(connected):
    """``packline stage train key=value`` after a validated run: the new settings are
    validated first, and validate's errors stop train before any training."""
    validate(make_config(connected, "mlflow.enabled=false"))
    cfg = make_config(
        connected, "mlflow.enabled=false", "packing.seq_length=512", "packing.overlength=fail"
    )
    with pytest.raises(UserError) as info:
        run_stage(cfg, "train")  # the runner renews validate's record first
    assert info.value.header.startswith("validate: 1 error(s)")
    assert any("packing.overlength" in p for p in info.value.problems), info.value.problems
    assert not (connected / "train").exists()  # nothing trained
    report = json.loads((connected / "validate" / "report.json").read_text())
    assert not report["ok"]  # the report is of the changed settings
    validate(make_config(connected, "mlflow.enabled=false"))  # leave it valid


# --- data against config ---------------------------------------------------------------------


def test_overlength_with_policy_fail_is_an_error(connected, lengths, capsys):
    code, problems, report = _validate(
        connected, capsys, "packing.seq_length=512", "packing.overlength=fail"
    )
    n, longest = int((lengths["total_tokens"] > 512).sum()), int(lengths["total_tokens"].max())
    assert n > 0
    expected = (
        f"{n} of {len(lengths)} samples are longer than packing.seq_length 512 (aligned to m = 1; "
        f"the longest has {longest} tokens) and packing.overlength is 'fail': the run would "
        f"stop at the first; fix: set packing.seq_length={longest}, or packing.overlength=drop "
        "to drop and count them"
    )
    assert code == 2 and problems == [expected]
    assert _texts(report, "error") == [expected]
    # seq_length is one of connect's inputs: its outputs are stale, which is only a warning
    assert _texts(report, "warning") == [STALE.format(work=connected)]
    assert read_record(make_config(connected).work_path, "validate") is None


def test_overlength_with_policy_drop_is_a_warning(connected, lengths, capsys):
    code, problems, report = _validate(connected, capsys, "packing.seq_length=512")
    n, longest = int((lengths["total_tokens"] > 512).sum()), int(lengths["total_tokens"].max())
    assert code == 0 and problems == []
    assert (
        f"{n} of {len(lengths)} samples are longer than packing.seq_length 512 (aligned to "
        f"m = 1; the longest has {longest} tokens): they will be dropped and counted as "
        f"overlength ({n / len(lengths):.1%}); fix: set packing.seq_length={longest} to keep "
        "them" in _texts(report, "warning")
    )
    assert report["facts"]["overlength"]["samples"] == n


def test_no_training_sample_fitting_is_an_error(connected, lengths, capsys):
    code, problems, _ = _validate(connected, capsys, "packing.seq_length=16")
    train = lengths[lengths["split"] == "train"]["total_tokens"]
    val = lengths[lengths["split"] == "val"]
    assert code == 2
    assert problems[0] == (
        f"none of the {len(train)} training samples fits in packing.seq_length 16 (the "
        f"shortest needs {int(train.min())} tokens after alignment); fix: set "
        f"packing.seq_length={int(train.max())} or more"
    )
    assert problems[1].startswith(
        f"none of the {len(val)} validation samples fits in packing.seq_length 16, and "
        "train.eval is on"
    )
    assert len(problems) == 2


def test_a_set_without_validation_rows_is_refused_unless_the_run_trains_without_eval(
    tmp_path, capsys
):
    """No val rows (the built-in set with ``data.num_val=0``): validate refuses train.eval
    on, with the fix; with train.eval=false it warns, and the run trains without eval (the
    train stage used to crash on Energon's "Invalid split part: 'val'")."""
    work = tmp_path / "work"
    small = ["data.num_train=12", "data.num_val=0", "train.max_steps=2", "train.save_every=2"]
    cfg = make_config(work, "mlflow.enabled=false", *small)
    prepare(cfg)
    connect(cfg)
    code, problems, _ = _validate(work, capsys, *small)
    assert code == 2
    assert problems == [
        "the data set has no validation rows, and train.eval is on: the eval at the start of "
        'training would have nothing to read; fix: give rows "split": "val" (a folder or '
        "LLaVA file: or leave split out of some rows, prepare.val_fraction sends that share of "
        "them to val), or a val split part to an Energon dataset's .nv-meta/split.yaml; or "
        "set train.eval=false to train without eval"
    ]
    no_eval = ["train.eval=false", "train.compare_packing=false"]
    code, problems, report = _validate(work, capsys, *small, *no_eval)
    assert code == 0 and problems == []
    (warned,) = [f for f in report["warnings"] if f["rule"] == "data.val_rows"]
    assert warned["message"].startswith("the data set has no validation rows: the run trains")
    result = train(make_config(work, "mlflow.enabled=false", *small, *no_eval))
    assert result.metrics["compare/packed_final_train_loss"] > 0
    run = work / "train" / "packed"
    assert not (run / "eval.jsonl").exists() and (run / "adapter" / "adapter_config.json").is_file()
    assert "- eval loss: not evaluated\n" in (run / "adapter" / "README.md").read_text()
    ran = json.loads((run / "result.json").read_text())["ran"]  # what trained, said
    assert ran == {
        "attention": "thd",  # auto, on this CPU
        "base_dtype": "float32",
        "adapter_dtype": "float32",
        "compute": "fp32",
        "activation_checkpointing": "false",
        "sharding": "none",
    }


def test_alignment_counts_in_the_overlength_check(connected, lengths, capsys):
    # CP 4 aligns every conversation to 8 tokens: a sample of 509 tokens needs 512.
    seq = 512
    code, _, report = _validate(
        connected, capsys, f"packing.seq_length={seq}", "packing.context_parallel=4"
    )
    aligned = lengths["total_tokens"].map(lambda n: align_up(int(n), 8))
    assert code == 0
    assert report["facts"]["alignment"] == 8
    assert report["facts"]["overlength"]["samples"] == int((aligned > seq).sum())


def test_more_images_than_prepare_max_images_is_an_error(connected, lengths, capsys):
    code, problems, _ = _validate(connected, capsys, "prepare.max_images=1")
    n = int((lengths["num_images"] > 1).sum())
    assert code == 2
    assert problems == [
        f"{n} samples have more than prepare.max_images 1 images (up to "
        f"{int(lengths['num_images'].max())}): the dataset was prepared under another limit; "
        "fix: rebuild the dataset with this limit: packline run --from prepare"
    ]


def test_megatron_encoder_limits_are_warnings(megatron, lengths, capsys):
    code, problems, report = _validate_megatron(
        megatron, capsys, DENSE, "megatron.max_num_images=1", "megatron.max_visual_tokens=100"
    )
    # Bridge counts a sample's image and video tokens together
    images, visual = lengths["num_images"], lengths["image_tokens"] + lengths["video_tokens"]
    assert code == 0 and problems == []
    assert [
        f"{f['message']}; fix: {f['fix']}"
        for f in report["warnings"]
        if f["rule"] == "megatron.encoder_limits"
    ] == [
        f"{int((images > 1).sum())} samples have more than megatron.max_num_images 1 "
        f"images (up to {int(images.max())}): Megatron-Bridge's encoder skips them without "
        f"counting them; fix: set megatron.max_num_images={int(images.max())}",
        f"{int((visual > 100).sum())} samples have more than megatron.max_visual_tokens "
        f"100 visual tokens (up to {int(visual.max())}): Megatron-Bridge's encoder skips them "
        f"without counting them; fix: set megatron.max_visual_tokens={int(visual.max())}",
    ]


def test_low_forecast_fill_at_the_configured_buffer_is_a_warning(connected, capsys):
    code, problems, report = _validate(connected, capsys, "packing.packing_buffer_size=1")
    # connect forecast the same stream independently; validate's figure must agree with it
    forecast = json.loads((connected / "connect" / "forecast.json").read_text())
    fills = {int(b): v["fill"] for b, v in forecast["buffers"].items()}
    bound = forecast["lower_bound"]["fill"]
    better = next(b for b in sorted(fills) if b > 1 and fills[b] >= 0.7)
    assert code == 0 and problems == []
    assert report["facts"]["forecast_fill"]["fill"] == pytest.approx(fills[1])
    assert _texts(report, "warning") == [
        f"the forecast fill at packing.packing_buffer_size 1 is {fills[1]:.3f}, below "
        f"validate.min_forecast_fill 0.7 (lower bound {bound:.3f}); fix: set "
        f"packing.packing_buffer_size={better} (forecast fill {fills[better]:.3f})"
    ]


def test_eager_buffer_over_the_memory_threshold_is_a_warning(connected, capsys):
    code, problems, report = _validate(
        connected, capsys, "packing.encoder=eager", "validate.worker_memory_warn_gib=0.05"
    )
    wm = report["facts"]["worker_memory"]
    eager, lazy = wm["per_worker_gib"]["eager"], wm["per_worker_gib"]["lazy"]
    mean = wm["mean_sample_mib"]["eager"]
    fitting = math.floor(0.05 * 1024**3 / (mean * 1024**2))
    assert code == 0 and problems == []
    assert eager == pytest.approx(64 * mean / 1024)
    assert _texts(report, "warning") == [
        f"packing.encoder eager holds about {eager:.2f} GiB per loader worker (64 buffered "
        f"samples x {mean:.2f} MiB of pixel tensors of images and sampled video frames on "
        f"average), above "
        f"validate.worker_memory_warn_gib 0.05; fix: set packing.encoder=lazy (about "
        f"{lazy:.2f} GiB at this buffer), or lower packing.packing_buffer_size to {fitting}"
    ]
    assert lazy < eager / 100  # lazy holds token ids and encoded media, not pixels


def _shard_samples(prepare_dir: Path) -> dict[str, tuple[list, list[bytes], list, list]]:
    """key → (conversation, image bytes, video bytes, video headers) read straight from the
    prepared tar shards."""
    parts: dict[str, dict[str, bytes]] = {}
    for shard in sorted(prepare_dir.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                parts.setdefault(key, {})[ext] = tar.extractfile(member).read()
    out = {}
    for key, files in parts.items():
        images = [files[e] for e in sorted(f for f in files if f.startswith("img"))]
        videos = [files[e] for e in sorted(f for f in files if f.startswith("vid"))]
        doc = json.loads(files["json"])
        out[key] = (doc["conversation"], images, videos, doc.get("videos", []))
    return out


def test_buffer_estimate_equals_the_bytes_the_real_encoders_hold(connected):
    cfg = make_config(connected, "mlflow.enabled=false")
    inputs = load_inputs(cfg, upstream(cfg))
    estimate = buffered_bytes(inputs)
    train = inputs.lengths[inputs.lengths["split"] == "train"].reset_index(drop=True)
    samples = _shard_samples(connected / "prepare")
    encoder = ConversationEncoder(connected / "connect" / "processor")
    picked = [
        0,
        1,
        2,
        *train.index[train["num_images"] > 1][:3],
        *train.index[train["num_videos"] > 0][:3],
        *train.index[-2:],
    ]
    assert (train.loc[picked, "num_videos"] > 0).sum() >= 3
    for i in picked:
        conversation, images, videos, headers = samples[train.loc[i, "key"]]
        tok = encoder.tokenize(train.loc[i, "key"], conversation, images, videos, headers)
        lazy = (
            tok.input_ids.nbytes
            + tok.target_mask.nbytes
            + sum(map(len, tok.images))
            + sum(map(len, tok.videos))
        )
        enc = encoder.encode_eager(train.loc[i, "key"], conversation, images, videos, headers)
        eager = sum(
            t.nbytes
            for t in (
                enc.input_ids,
                enc.target_mask,
                enc.mrope,
                enc.pixel_values,
                enc.image_grid_thw,
                enc.pixel_values_videos,
                enc.video_grid_thw,
            )
            if t is not None
        )
        assert (estimate["lazy"][i], estimate["eager"][i]) == (lazy, eager), i


def _tampered(connected: Path, tmp_path: Path, change) -> Path:
    work = tmp_path / "work"
    for name in ("prepare", "connect"):
        shutil.copytree(connected / name, work / name, symlinks=True)
    path = work / "connect" / "lengths.parquet"
    change(pd.read_parquet(path)).to_parquet(path, index=False)
    return work


def test_lengths_and_manifest_disagreeing_are_errors(connected, tmp_path, capsys):
    def change(df: pd.DataFrame) -> pd.DataFrame:
        ghost = df.iloc[[0]].assign(key="ghost-000001")
        dup = df.iloc[[1]]
        df = df.drop(index=2)  # a manifest key with no lengths
        df.loc[3, "split"] = "val"  # another split than the manifest says
        return pd.concat([df, ghost, dup], ignore_index=True)

    lengths = pd.read_parquet(connected / "connect" / "lengths.parquet")
    key = lengths["key"]
    work = _tampered(connected, tmp_path, change)
    code, problems, report = _validate(work, capsys)
    fix = "fix: remeasure this prepared dataset: packline run --from connect"
    assert code == 2
    assert problems == [
        f"lengths.parquet has 1 duplicated key(s): '{key[1]}'; {fix}",
        f"1 lengths.parquet key(s) not in manifest.parquet: 'ghost-000001'; {fix}",
        f"1 manifest.parquet key(s) missing from lengths.parquet: '{key[2]}'; {fix}",
        f"1 key(s) with another split in lengths.parquet than in the manifest: '{key[3]}'; {fix}",
    ]
    assert {f["setting"] for f in report["errors"]} == {"lengths.parquet"}


# --- model against data ----------------------------------------------------------------------


def _model_dir(connected: Path, tmp_path: Path, change=None, *, weights: bytes | None = None):
    """A local checkpoint dir holding the tiny model's real HF config.json (changed by
    ``change``), and optionally a weights file with the given bytes."""
    config = tiny_config(load_processor(connected / "connect" / "processor"))
    if change:
        change(config)
    out = tmp_path / "model"
    config.save_pretrained(out)
    if weights is not None:
        (out / "model.safetensors").write_bytes(weights)
    return out


def test_processor_and_model_token_ids_disagreeing_is_an_error(connected, tmp_path, capsys):
    ids = special_token_ids(load_processor(connected / "connect" / "processor"))

    def change(config):
        config.image_token_id = 7
        config.vision_start_token_id = 8

    model = _model_dir(connected, tmp_path, change)
    code, problems, _ = _validate(connected, capsys, f"model.path={model}")
    assert code == 2
    assert problems == [
        f"the processor's image_token_id is {ids['image_token_id']} (<|image_pad|>) but the "
        "model config's is 7: the model would not find the processor's <|image_pad|> tokens; "
        f"fix: {SAME_CHECKPOINT}",
        f"the processor's vision_start_token_id is {ids['vision_start_token_id']} "
        "(<|vision_start|>) but the model config's is 8: the model would not find the "
        f"processor's <|vision_start|> tokens; fix: {SAME_CHECKPOINT}",
    ]


def test_processor_vocab_larger_than_the_model_is_an_error(connected, tmp_path, capsys):
    def change(config):
        config.text_config.vocab_size = 4000

    code, problems, _ = _validate(
        connected, capsys, f"model.path={_model_dir(connected, tmp_path, change)}"
    )
    assert code == 2
    assert problems == [
        "the processor has 4096 token ids but the model's text_config.vocab_size is 4000: ids "
        f"from 4000 on index past the embedding; fix: {SAME_CHECKPOINT}"
    ]


def test_vision_geometry_disagreeing_with_the_processor_is_an_error(connected, tmp_path, capsys):
    def change(config):
        config.vision_config.patch_size = 14
        config.vision_config.spatial_merge_size = 3

    code, problems, _ = _validate(
        connected, capsys, f"model.path={_model_dir(connected, tmp_path, change)}"
    )
    assert code == 2
    assert problems == [
        "the processor's patch_size is 16 but the model's vision_config.patch_size is 14: image "
        f"patches would not match the vision tower; fix: {SAME_CHECKPOINT}",
        "the processor's merge_size is 2 but the model's vision_config.spatial_merge_size is 3: "
        f"image patches would not match the vision tower; fix: {SAME_CHECKPOINT}",
    ]


def test_vision_width_unequal_to_the_text_width_is_an_error(connected, tmp_path, capsys):
    def change(config):
        config.vision_config.out_hidden_size = 96

    code, problems, _ = _validate(
        connected, capsys, f"model.path={_model_dir(connected, tmp_path, change)}"
    )
    assert code == 2
    assert problems == [
        "the model's vision_config.out_hidden_size is 96 but its text_config.hidden_size is "
        "128: merged image features cannot enter the language model; fix: use a consistent "
        "Qwen3-VL config.json"
    ]


def test_model_path_without_a_qwen3_vl_config_is_an_error(connected, tmp_path, capsys):
    model = tmp_path / "llama"
    LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(model)
    code, problems, report = _validate(connected, capsys, f"model.path={model}")
    assert code == 2
    assert problems == [
        f"model.path '{model}': its config.json is a 'llama' model, not Qwen3-VL (qwen3_vl or "
        "qwen3_vl_moe); fix: point model.path at a local Hugging Face Qwen3-VL checkpoint dir "
        "(its config.json is all validate reads)"
    ]
    status = {c["rule"]: c["status"] for c in report["checks"]}
    assert status["lora.targets"] == status["model.token_ids"] == "not applicable"

    fix = (
        "fix: point model.path at a local Hugging Face Qwen3-VL checkpoint dir (its "
        "config.json is all validate reads)"
    )
    (tmp_path / "empty").mkdir()
    for path, problem in (
        (tmp_path / "missing", "not a directory"),
        (tmp_path / "empty", "it holds no config.json"),
    ):
        code, problems, _ = _validate(connected, capsys, f"model.path={path}")
        assert code == 2 and problems == [f"model.path '{path}': {problem}; {fix}"]


def test_validate_reads_no_weights(connected, tmp_path, capsys):
    """A checkpoint whose weights file is garbage passes: validate reads only config.json
    and builds the model on the meta device. Loading it, as train does, fails."""
    model = _model_dir(connected, tmp_path, weights=b"not a safetensors file" * 100)
    code, problems, report = _validate(connected, capsys, f"model.path={model}")
    assert code == 0 and problems == [] and report["ok"]
    assert report["facts"]["lora_targets"]["module:q_proj"] == 2
    cfg = make_config(connected, f"model.path={model}")
    with pytest.raises(Exception):  # noqa: B017 - any loader error proves the bytes are read
        build_model(cfg, load_processor(connected / "connect" / "processor"))


def test_lora_targets_matching_nothing_on_moe_experts_are_errors(connected, capsys):
    code, problems, report = _validate(connected, capsys, "model.moe=true", "model.path=null")
    fix = "lora.target_parameters=[mlp.experts.down_proj,mlp.experts.gate_up_proj]"
    assert code == 2
    assert problems == [
        f"lora.target_modules entry '{t}' matches no module of the model: its MoE experts are "
        "3-D parameters, which target_modules never match, so the adapter would silently not "
        f"train them; fix: remove '{t}' from lora.target_modules and set {fix}"
        for t in ("gate_proj", "up_proj", "down_proj")
    ]
    assert report["facts"]["lora_targets"]["module:gate_proj"] == 0
    code, problems, _ = _validate(
        connected,
        capsys,
        "model.moe=true",
        "model.path=null",
        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
    )
    assert code == 0 and problems == []


def test_model_moe_must_say_what_model_path_holds(connected, tmp_path, capsys):
    dense = _model_dir(connected, tmp_path)  # a dense Qwen3-VL checkpoint's config.json
    code, problems, _ = _validate(
        connected,
        capsys,
        "model.moe=true",
        f"model.path={dense}",
        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
    )
    assert code == 2
    assert problems[0] == (
        f"model.moe is true but model.path '{dense}' holds a dense (qwen3_vl) model: the MoE "
        "settings (experts, EP, the router's loss) would not apply to what trains; fix: set "
        "model.path=null to build the tiny MoE at random, or point model.path at an MoE "
        "checkpoint"
    )
    moe = tmp_path / "moe"
    tiny_config(load_processor(connected / "connect" / "processor"), moe=True).save_pretrained(moe)
    code, problems, _ = _validate(connected, capsys, f"model.path={moe}")
    assert code == 2
    assert (
        f"model.moe is false but model.path '{moe}' holds an MoE (qwen3_vl_moe) model: the MoE "
        "settings (experts, EP, the router's loss) would not apply to what trains; fix: set "
        "model.moe=true"
    ) in problems


def test_lora_target_typos_and_unwrappable_modules_are_errors(connected, capsys):
    code, problems, _ = _validate(
        connected,
        capsys,
        "lora.target_modules=[q_prj,mlp,v_proj]",
        "lora.target_parameters=[experts.gate_proj]",
    )
    assert code == 2
    assert problems == [
        "lora.target_modules entry 'q_prj' matches no module of the model; fix: remove it, or "
        "name a linear layer of the model (did you mean 'q_proj'?)",
        "lora.target_modules entry 'mlp' matches only modules LoRA cannot wrap (Qwen3VLVisionMLP, "
        "e.g. model.visual.blocks.0.mlp); fix: target the linear layers inside it by name",
        "lora.target_parameters entry 'experts.gate_proj' matches no parameter of the model; "
        "fix: remove it, or name a parameter by its path",
    ]


# --- all at once -----------------------------------------------------------------------------


def test_three_broken_rules_of_data_and_model_are_listed_together(connected, lengths, capsys):
    code, problems, report = _validate(
        connected,
        capsys,
        "packing.overlength=fail",
        "packing.seq_length=512",
        "prepare.max_images=1",
        "lora.target_modules=[q_prj]",
    )
    assert code == 2
    assert [p.split(" ", 3)[:3] for p in problems] == [
        [str(int((lengths["total_tokens"] > 512).sum())), "of", str(len(lengths))],
        [str(int((lengths["num_images"] > 1).sum())), "samples", "have"],
        ["lora.target_modules", "entry", "'q_prj'"],
    ]
    assert [f["rule"] for f in report["errors"]] == [
        "data.overlength",
        "data.images_per_sample",
        "lora.targets",
    ]
    assert {f["setting"] for f in report["errors"]} == {
        "packing.overlength",
        "prepare.max_images",
        "lora.target_modules",
    }


def test_the_stage_itself_rechecks_config_rules_on_the_object_it_gets(connected):
    """load_config refuses these; a config object changed in code reaches the stage, which
    lists the section rule and the guardrail in its report too."""
    cfg = make_config(connected, "mlflow.enabled=false")
    cfg.train.micro_batch_size = 2
    cfg.lora.rank = 0
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert info.value.problems == [
        "lora.rank must be > 0, got 0; fix: set lora.rank to a value > 0 (default 8)",
        "train.micro_batch_size is 2, but a packed micro-batch is exactly one row; fix: set "
        "train.micro_batch_size=1 (pack more conversations per row instead)",
    ]
    report = json.loads((connected / "validate" / "report.json").read_text())
    assert [f["rule"] for f in report["errors"]] == ["config.lora", "packing.micro_batch"]


def test_validate_shows_connects_flops_forecast(connected, capsys):
    code, problems, report = _validate(connected, capsys)
    assert code == 0 and problems == []
    forecast = json.loads((connected / "connect" / "forecast.json").read_text())["flops"]
    assert report["facts"]["flops_forecast"] == forecast
    record = json.loads((connected / "validate" / "_COMPLETE.json").read_text())
    for key in ("epoch_useful", "epoch_executed_packed", "epoch_executed_unpacked", "saving"):
        assert record["metrics"][f"flops/{key}"] == pytest.approx(forecast[key])
    assert forecast["epoch_executed_unpacked"] > forecast["epoch_executed_packed"]


# --- the SLURM and Megatron rules, in the same pass --------------------------------------------


@pytest.fixture(scope="module")
def megatron(connected, tmp_path_factory) -> dict[str, Path]:
    """The connected tiny set in a work dir of its own, plus stand-ins for the cluster's dirs:
    the tiny processor as ``processor.path`` and the tiny dense and MoE models' config.json as
    ``model.path`` (validate reads no weights)."""
    root = tmp_path_factory.mktemp("megatron")
    work = root / "work"
    for name in ("prepare", "connect"):
        shutil.copytree(connected / name, work / name, symlinks=True)
    processor = shutil.copytree(connected / "connect" / "processor", root / "processor")
    dirs = {"work": work, "processor": processor}
    for moe in (False, True):
        dirs["moe" if moe else "dense"] = root / ("moe" if moe else "dense")
        tiny_config(load_processor(processor), moe=moe).save_pretrained(
            dirs["moe" if moe else "dense"]
        )
    return dirs


def _validate_megatron(dirs: dict[str, Path], capsys, config: Path, *overrides: str):
    """``packline stage validate`` on a shipped cluster config, with the stand-in dirs."""
    model = dirs["moe"] if config == MOE else dirs["dense"]
    return _validate(
        dirs["work"],
        capsys,
        f"processor.path={dirs['processor']}",
        f"model.path={model}",
        *overrides,
        config=config,
    )


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["8b_1node", "30b_a3b_ep8"])
def test_shipped_cluster_configs_pass_every_rule_in_one_pass(megatron, capsys, config):
    code, problems, report = _validate_megatron(megatron, capsys, config)
    assert code == 0 and problems == [] and report["ok"]
    status = {c["rule"]: c["status"] for c in report["checks"]}
    for rule in (
        "megatron.executor",
        "megatron.paths",
        "megatron.world",
        "megatron.extra_override_fields",
        "megatron.micro_batch",
        "megatron.eval_micro_batch",
        "megatron.dist_train",
        "megatron.alignment",
        "model.config",
        "lora.targets",
    ):
        assert status[rule] == "ok", rule
    assert status["slurm.parallel"] == "not applicable"  # Bridge splits its GPUs itself
    # packline's dataset for Bridge has no legacy in-batch packing flags (Bridge's own does)
    assert status["megatron.in_batch_packing"] == "not applicable"
    allowed = {"data.current", "packing.forecast_fill", "megatron.media_first"}
    assert {f["rule"] for f in report["warnings"]} <= allowed
    # the samples whose images Bridge moves before their turn's text are counted
    moved = int(
        pd.read_parquet(megatron["work"] / "connect" / "lengths.parquet")["images_moved"].sum()
    )
    assert moved > 0 and report["facts"]["images_moved"] == moved
    (media_first,) = [f for f in report["warnings"] if f["rule"] == "megatron.media_first"]
    assert f"{moved} of " in media_first["message"]


EXTRA = "megatron.extra_overrides"
DIST_TRAIN = (
    "model.dist_train.use_dist_train=true (from megatron.extra_overrides): Megatron-Bridge's "
    "native packing does not support Qwen3-VL DistTrain (separate vision and language ranks); "
    "fix: remove model.dist_train.use_dist_train from megatron.extra_overrides"
)
EVAL_MBS = (
    "validation.eval_micro_batch_size=2 (from megatron.extra_overrides), but the Energon "
    "dataset's micro-batch is 1: Megatron-Bridge requires them equal (the eval loader batches as "
    "the dataset does); fix: remove validation.eval_micro_batch_size from "
    "megatron.extra_overrides"
)
UNKNOWN_KEY = (
    "megatron.extra_overrides key 'model.tensor_parallel_size' is not a Megatron-Bridge config "
    "field: Qwen3VLModelProvider at model has no field 'tensor_parallel_size' (did you mean "
    "'tensor_model_parallel_size'?); fix: correct or remove 'model.tensor_parallel_size' in "
    "megatron.extra_overrides"
)
BRIDGE_RULES = [
    ("megatron.dist_train", DENSE, [f"{EXTRA}=[model.dist_train.use_dist_train=true]"], DIST_TRAIN),
    (
        "megatron.eval_micro_batch",
        DENSE,
        [f"{EXTRA}=[validation.eval_micro_batch_size=2]"],
        EVAL_MBS,
    ),
    (
        "megatron.micro_batch",
        DENSE,
        [f"{EXTRA}=[train.micro_batch_size=2]"],
        "train.micro_batch_size=2 (from megatron.extra_overrides): Energon native packing in "
        "Megatron-Bridge needs one packed row per micro-batch; fix: remove "
        "train.micro_batch_size from megatron.extra_overrides",
    ),
    (
        "megatron.extra_override_fields",
        DENSE,
        [f"{EXTRA}=[model.tensor_parallel_size=2]"],
        UNKNOWN_KEY,
    ),
    (
        "megatron.alignment",
        MOE,
        ["packing.tensor_parallel=2", "packing.seq_length=4095"],
        "packing.seq_length 4095 is not a multiple of the alignment the run pads each "
        "conversation to, m = 2 (CP 1, TP 2, SP on: Megatron-Bridge's MoE provider turns "
        "sequence parallelism on when TP > 1); fix: set packing.seq_length=4096 or 4094",
    ),
]


@pytest.mark.parametrize(
    ("rule", "config", "overrides", "problem"), BRIDGE_RULES, ids=[r[0] for r in BRIDGE_RULES]
)
def test_a_bridge_rule_broken_alone_is_listed_and_exits_2(
    megatron, capsys, rule, config, overrides, problem
):
    code, problems, report = _validate_megatron(megatron, capsys, config, *overrides)
    assert code == 2 and problems == [problem]
    assert [f["rule"] for f in report["errors"]] == [rule]
    assert read_record(make_config(megatron["work"]).work_path, "validate") is None


def test_three_broken_bridge_rules_are_listed_together(megatron, capsys):
    extra = "model.dist_train.use_dist_train=true,validation.eval_micro_batch_size=2," + (
        "model.tensor_parallel_size=2"
    )
    code, problems, report = _validate_megatron(megatron, capsys, DENSE, f"{EXTRA}=[{extra}]")
    assert code == 2 and problems == [UNKNOWN_KEY, EVAL_MBS, DIST_TRAIN]
    assert [f["rule"] for f in report["errors"]] == [
        "megatron.extra_override_fields",
        "megatron.eval_micro_batch",
        "megatron.dist_train",
    ]


def test_the_slurm_rule_run_refuses_is_listed_by_validate(connected, capsys):
    # the local backend on SLURM: 8 GPUs per node -> 8 data-parallel ranks for a batch of 4
    code, problems, report = _validate(connected, capsys, "executor.kind=slurm")
    assert code == 2
    assert problems == [
        "train.parallel: train.global_batch_size 4 is not divisible by the 8 data-parallel "
        "ranks (the SLURM train job's 8 ranks: nodes 1 × nproc_per_node 8; pipeline_parallel 1, "
        "expert_parallel 1); fix: change train.parallel, executor.slurm.nproc_per_node or "
        "train.global_batch_size (docs/parallel.md)"
    ]
    assert [f["rule"] for f in report["errors"]] == ["slurm.parallel"]
    code, problems, _ = _validate(
        connected, capsys, "executor.kind=slurm", "executor.slurm.nproc_per_node=2"
    )
    assert code == 0 and problems == []


@pytest.mark.parametrize("attention", ["varlen", "flex"])
def test_an_attention_that_cannot_train_on_this_machine_is_an_error(connected, capsys, attention):
    """This machine has no GPU: varlen's flash kernel and flex's backward are CUDA's."""
    code, problems, report = _validate(connected, capsys, f"model.attention={attention}")
    assert code == 2
    (problem,) = [p for p in problems if p.startswith("model.attention")]
    why = (
        "its flash kernel runs on CUDA only, not on cpu"
        if attention == "varlen"
        else f"torch {torch.__version__}'s FlexAttention has no backward on cpu"
    )
    assert problem == (
        f"model.attention {attention} cannot train here: {why}; fix: set model.attention=auto "
        "(varlen where it runs, thd elsewhere)"
    )
    code, _, report = _validate(connected, capsys, "model.attention=auto")
    assert code == 0 and report["facts"]["attention"] == {"configured": "auto", "runs": "thd"}


def test_validate_prints_the_memory_forecast_and_refuses_a_gpu_it_exceeds(connected, capsys):
    code, _, report = _validate(connected, capsys)
    memory = report["facts"]["memory"]
    assert code == 0 and memory["total"] > memory["weights"] > 0
    assert memory["line"].startswith(f"{memory['total']:.2f} GiB per GPU: weights")
    code, problems, _ = _validate(connected, capsys, "train.gpu_memory_gib=0.01")
    assert code == 2
    (problem,) = [p for p in problems if "a training step needs about" in p]
    assert problem.endswith(
        "the GPU has 0.0 GiB; fix: set train.activation_checkpointing=true, or a smaller "
        "packing.seq_length or train.unpacked_micro_batch_size, or train.parallel.fsdp=true "
        "over several GPUs"
    )
