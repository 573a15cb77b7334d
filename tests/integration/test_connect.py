from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from packline.packing.forecast import forecast_fill
from schemas.config import Algorithm
from schemas.errors import UserError
from schemas.tables import LengthsModel
from stages.connect import connect
from stages.prepare import prepare
from tests.conftest import make_config


def floor_rule(height: int, width: int) -> int:
    """A plausible but wrong cheap rule: floor to 32 px blocks instead of smart_resize."""
    return (height // 32) * (width // 32)


@pytest.fixture(scope="module")
def default_set(tmp_path_factory) -> Path:
    """The built-in set at its default size, prepared and connected once for the module."""
    work = tmp_path_factory.mktemp("default") / "work"
    cfg = make_config(work, "data.num_train=2000", "data.num_val=200", "prepare.num_workers=2")
    prepare(cfg)
    result = connect(cfg)
    return result.out_dir, result, cfg


def test_connect_cheap_length_equals_processor_for_every_default_sample(default_set):
    out, result, cfg = default_set
    lengths = pd.read_parquet(out / "lengths.parquet")
    assert len(lengths) == 2200
    assert result.metrics["connect/cheap_mismatches"] == 0
    LengthsModel.validate(lengths, lazy=True)  # the table passes its pandera model
    manifest = pd.read_parquet(cfg.work_path / "prepare" / "manifest.parquet")
    merged = manifest.merge(lengths, on="key", suffixes=("_m", ""))
    assert len(merged) == 2200
    assert (merged["num_images_m"] == merged["num_images"]).all()
    assert (merged["split_m"] == merged["split"]).all()
    # The set spans the intended range: text-only rows and images up to ~1,000 tokens.
    assert (lengths["num_images"] == 0).sum() > 200
    assert lengths["image_tokens"].max() >= 900


def test_connect_forecast_is_monotone_and_bounded(default_set):
    from packline.catalog import read_forecast
    from packline.packing.forecast import packing_metrics

    out, result, cfg = default_set
    forecast = json.loads((out / "forecast.json").read_text())
    buffers = [forecast["buffers"][str(b)] for b in (1, 16, 64, 256, 1024)]
    fills = [v["fill"] for v in buffers]  # with carry-over (the default, 4 rounds)
    energon = [v["fill_without_carry"] for v in buffers]  # Energon's own rounds
    assert forecast["max_carry_rounds"] == 4
    assert fills[0] == energon[0] == pytest.approx(forecast["unpacked"]["fill"])
    assert all(a <= b + 1e-9 for a, b in zip(energon, energon[1:], strict=False))
    assert all(c >= e - 1e-9 for c, e in zip(fills, energon, strict=True))
    assert fills[1] > energon[1] + 0.1  # a buffer of 16: the per-round bound lifted
    assert max(fills) <= forecast["lower_bound"]["fill"] + 1e-9
    assert forecast["lower_bound"]["fill"] > 0.95
    assert (out / "length_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.metrics["connect/forecast_fill_b64"] == pytest.approx(fills[2])
    assert result.metrics["connect/forecast_fill_nocarry_b64"] == pytest.approx(energon[2])
    # The default config's packer: backend local, refined, one stream; the FLOPs forecast
    # packs the same stream into the same rows at the configured buffer (64).
    assert (forecast["backend"], forecast["algorithm"]) == ("local", "refined")
    assert (forecast["num_ranks"], forecast["num_workers"]) == (1, 0)
    assert result.metrics["flops/rows_packed"] == forecast["buffers"]["64"]["packs"]
    # one data-parallel rank: nobody waits (the figure itself: tests/unit/test_forecast.py)
    assert result.metrics["flops/straggler_ratio"] == 1.0
    assert result.metrics["flops/straggler_ranks"] == 1.0
    # what a train run logs of its packs: the configured buffer's fill, from the same forecast
    figures = packing_metrics(read_forecast(cfg))
    assert figures["packing/forecast_fill"] == pytest.approx(forecast["buffers"]["64"]["fill"])
    assert figures["packing/forecast_rows"] == forecast["buffers"]["64"]["packs"]
    # every sample's FLOPs alone, positive and growing with its length at a given image count
    lengths = pd.read_parquet(out / "lengths.parquet")
    text = lengths[lengths["num_images"] + lengths["num_videos"] == 0].sort_values("total_tokens")
    assert (lengths["flops"] > 0).all() and text["flops"].is_monotonic_increasing


def test_connect_catches_a_wrong_cheap_rule(tmp_path: Path):
    cfg = make_config(tmp_path / "work")
    prepare(cfg)
    with pytest.raises(UserError) as info:
        connect(cfg, visual_tokens=floor_rule)
    assert "cheap length rule disagrees with the processor" in info.value.header
    pattern = (
        r"^\S+: the processor counts (\d+) tokens \((\d+) image, \d+ loss\), the cheap rule (\d+)"
    )
    first = re.match(pattern, info.value.problems[0])
    assert first is not None, info.value.problems[0]
    assert first.group(1) != first.group(3)
    assert not (cfg.work_path / "connect" / "_COMPLETE.json").exists()


def test_forecast_fill_worked_example():
    # capacity 10, one buffer of 4: FFD packs [6,4] and [5,3] → 18 / 20.
    out = forecast_fill([6, 5, 4, 3], 10, [1, 4], Algorithm.ffd, seed=0)
    assert out["buffers"]["1"] == {"packs": 4, "fill": 18 / 40}
    assert out["buffers"]["4"] == {"packs": 2, "fill": 18 / 20}
    assert out["lower_bound"] == {"packs": 2, "fill": 18 / 20}
    assert (out["samples"], out["tokens"], out["backend"], out["algorithm"]) == (
        4,
        18,
        "local",
        "ffd",
    )
    # Seed 0 streams the table positions [2, 0, 1, 3]. Two ranks split that stream 2 + 2:
    # [6, 6] and [4, 4] take 3 rows where one stream's buffer of 4 takes 2.
    one = forecast_fill([6, 4, 6, 4], 10, [4], "ffd", seed=0)
    two = forecast_fill([6, 4, 6, 4], 10, [4], "ffd", seed=0, num_ranks=2)
    assert one["buffers"]["4"]["packs"] == 2 and two["buffers"]["4"]["packs"] == 3
    assert two["num_ranks"] == 2
    # The stream [4, 12, 6, 5] at B=2: locally the 12 takes a slot ([4, 12] → [4]; [6, 5] →
    # 2 rows), Bridge skips it before its buffer ([4, 6] → 1 row; [5] → 1).
    local = forecast_fill([12, 6, 4, 5], 10, [2], "ffd", seed=0)
    bridge = forecast_fill([12, 6, 4, 5], 10, [2], "ffd", seed=0, backend="megatron")
    assert local["samples"] == bridge["samples"] == 3 and local["tokens"] == 15
    assert local["buffers"]["2"] == {"packs": 3, "fill": 15 / 30}
    assert bridge["buffers"]["2"] == {"packs": 2, "fill": 15 / 20}


def _hf_style_processor_dir(root: Path) -> Path:
    """A processor dir laid out like a downloaded Qwen3-VL one: preprocessor_config.json
    naming the torchvision image processor by its legacy name with Qwen3-VL's real pixel
    bounds, the video config, and a chat_template.json without {% generation %} markers."""
    from packline.qwen.processor import copy_tiny_processor

    d = copy_tiny_processor(root / "hf")
    image_cfg = json.loads((d / "preprocessor_config.json").read_text())
    image_cfg["image_processor_type"] = "Qwen2VLImageProcessorFast"
    image_cfg["size"] = {"shortest_edge": 65536, "longest_edge": 16777216}
    (d / "preprocessor_config.json").write_text(json.dumps(image_cfg))
    template = (d / "chat_template.jinja").read_text()
    template = template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (d / "chat_template.jinja").unlink()
    return d


def test_connect_with_a_hf_style_processor_dir(tmp_path: Path):
    proc = _hf_style_processor_dir(tmp_path)
    cfg = make_config(tmp_path / "work", f"processor.path={proc}")
    prepare(cfg)
    result = connect(cfg)
    lengths = pd.read_parquet(result.out_dir / "lengths.parquet")
    assert result.metrics["connect/cheap_mismatches"] == 0
    # Qwen3-VL's real minimum of 65,536 pixels upscales every image to >= 64 visual tokens.
    with_images = lengths[lengths["num_images"] > 0]
    assert (with_images["image_tokens"] >= 64 * with_images["num_images"]).all()
    assert (result.out_dir / "processor" / "preprocessor_config.json").is_file()


def test_flops_forecast_equals_an_actual_epoch_through_the_loader(default_set):
    from packline.counters import PackCounts, flops_model_for
    from packline.energon.loader import train_loader
    from packline.energon.packing import PackingSettings, make_encoder
    from packline.qwen.processor import load_processor

    out, result, cfg = default_set
    forecast = json.loads((out / "forecast.json").read_text())["flops"]
    processor_dir = out / "processor"
    model = flops_model_for(cfg, load_processor(processor_dir))
    encoder = make_encoder("lazy", processor_dir, PackingSettings.from_config(cfg.packing))
    loader = train_loader(
        cfg.work_path / "prepare",
        encoder,
        packing_buffer_size=cfg.packing.packing_buffer_size,
        repeat=False,
    )
    total = PackCounts()
    for pack in loader:
        total = total + PackCounts.of(pack.batch, model, cfg.packing.seq_length)
    assert total.flops_useful == pytest.approx(forecast["epoch_useful"], rel=0.01)
    assert total.tokens_real == forecast["tokens_real"]
    # The loader's stream order differs from the forecast's, so the packs do too: the
    # executed (padding-inclusive) figure agrees closely but not exactly.
    assert total.flops_executed == pytest.approx(forecast["epoch_executed_packed"], rel=0.02)
    # THD rows with m = 1 and no fixed width carry no padding; padded batches do.
    assert forecast["padding_share_packed"] == 0.0
    assert 0.2 < forecast["padding_share_unpacked"] < 1
    assert result.metrics["flops/saving"] == pytest.approx(forecast["saving"])


# --- spreading over tasks and workers, parts, resume, verify ---------------------------------

#: the small built-in set in 7 shards (6 train, 1 val): the tasks' shares cut across shards
SHARDED = ("prepare.samples_per_shard=10",)
#: a connect run as a task of a SLURM job (with the SLURM variables set) takes its rank there
ON_SLURM = ("executor.kind=slurm", "executor.slurm.account=a")


def _lengths(result) -> pd.DataFrame:
    return pd.read_parquet(result.out_dir / "lengths.parquet")


@pytest.fixture(scope="module")
def one_task(tmp_path_factory):
    """The small set connected as one task: the table every other layout must equal."""
    cfg = make_config(tmp_path_factory.mktemp("one") / "work", *SHARDED)
    prepare(cfg)
    result = connect(cfg)
    return cfg, result, _lengths(result)


def _measuring(cfg, processor: Path, *, num_workers: int, part_size: int = 1):
    from packline.catalog import dataset_path
    from packline.energon.measure import Measuring

    return Measuring(
        dataset=dataset_path(cfg),
        processor=processor,
        splits=("train", "val"),
        num_workers=num_workers,
        part_size=part_size,
        verify_keys=None,
    )


def _share_keys(loader) -> list[str]:
    return [sample.__key__ for batch in loader for sample in batch]


@pytest.mark.slow  # tens of seconds: several loaders or connects
@pytest.mark.parametrize("num_workers", [0, 2])
def test_task_shares_hold_every_sample_once_for_any_task_count(one_task, num_workers):
    from packline.energon.measure import share_loader
    from packline.energon.parts import Task
    from packline.energon.sample import ConversationReader

    cfg, result, _ = one_task
    manifest = pd.read_parquet(cfg.work_path / "prepare" / "manifest.parquet")
    m = _measuring(cfg, result.out_dir / "processor", num_workers=num_workers)
    for world in (2, 3):
        for split in ("train", "val"):
            keys = [
                key
                for rank in range(world)
                for key in _share_keys(
                    share_loader(m, split, Task(rank, world), ConversationReader())
                )
            ]
            assert sorted(keys) == sorted(manifest.loc[manifest["split"] == split, "key"])
            assert len(keys) == len(set(keys)), (world, split)


@pytest.mark.slow  # tens of seconds: several loaders or connects
@pytest.mark.parametrize("split", ["train", "val"])
def test_a_restored_share_continues_after_the_saved_sample(one_task, split):
    """Energon's own save_state_rank/restore_state_rank on a task's share, with 2 workers:
    the restored loader yields the samples after the saved one, in the same order. Where a
    worker had already handed over its whole share (the last samples of the share), Energon
    7.4 restores that worker as a fresh epoch and it yields its share again: samples seen
    before the cut, which measure_share drops unmeasured (LengthReader's skip_keys)."""
    import pickle

    from packline.energon.measure import share_loader
    from packline.energon.parts import Task
    from packline.energon.sample import ConversationReader

    cfg, result, _ = one_task
    m = _measuring(cfg, result.out_dir / "processor", num_workers=2)
    task = Task(0, 2)
    full = _share_keys(share_loader(m, split, task, ConversationReader()))
    for cut in sorted({1, len(full) // 2, len(full) - 2, len(full) - 1} - {0}):
        loader = share_loader(m, split, task, ConversationReader())
        batches = iter(loader)
        first = [sample.__key__ for _ in range(cut) for sample in next(batches)]
        state = pickle.dumps(loader.save_state_rank())
        # saving does not disturb the stream (and a loader read to its end shuts its
        # workers down at once; one left in the middle takes seconds)
        assert first + [sample.__key__ for batch in batches for sample in batch] == full
        restored = share_loader(m, split, task, ConversationReader())
        restored.restore_state_rank(pickle.loads(state))
        rest = _share_keys(restored)
        again = [key for key in rest if key in set(first)]
        assert first + [key for key in rest if key not in set(first)] == full, cut
        if cut < len(full) - m.num_workers:  # no worker had handed over its whole share
            assert again == [], cut


@pytest.mark.slow  # tens of seconds: several loaders or connects
def test_connect_as_two_slurm_tasks_equals_one_task_and_logs_one_run(
    one_task, tmp_path: Path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from packline.tracking import tracking_uri
    from stages.base import read_record
    from stages.runner import run_stage

    _, reference, table = one_task
    cfg = make_config(
        tmp_path / "work", *SHARDED, *ON_SLURM, "connect.num_tasks=2", "connect.part_size=7"
    )
    prepare(cfg)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    first = run_stage(cfg, "connect")
    assert first.partial and read_record(cfg.work_path, "connect") is None
    assert not (cfg.work_path / "connect").exists()
    client = MlflowClient(tracking_uri=tracking_uri(cfg))
    assert (
        client.get_experiment_by_name(cfg.name) is None
    )  # the task that did not merge logs nothing
    monkeypatch.setenv("SLURM_PROCID", "1")
    second = run_stage(cfg, "connect")
    assert not second.partial
    pd.testing.assert_frame_equal(_lengths(second), table)
    m = second.metrics
    assert (m["connect/tasks"], m["connect/samples"], m["connect/samples_measured"]) == (2, 68, 68)
    assert m["connect/parts_resumed"] == 0
    tasks = second.summary["tasks"]
    assert [t["rank"] for t in tasks] == [0, 1] and sum(t["samples"] for t in tasks) == 68
    assert 0 < tasks[0]["samples"] < 68
    # (the packed forecast differs: executor slurm trains on the SLURM job's 8 ranks)
    for key in ("flops/epoch_useful", "flops/tokens_real", "connect/tokens_total"):
        assert m[key] == reference.metrics[key], key
    assert not (cfg.work_path / "connect.parts").exists()  # merged, then removed
    runs = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])
    assert [(r.info.run_name, r.info.status) for r in runs] == [("connect", "FINISHED")]
    assert runs[0].data.metrics["connect/tasks"] == 2
    # A third task that starts once the stage is up to date logs no second run.
    monkeypatch.setenv("SLURM_PROCID", "1")
    run_stage(cfg, "connect")
    assert len(client.search_runs([runs[0].info.experiment_id])) == 1


def test_connect_tasks_given_explicitly_with_no_loader_workers_equal_one_task(
    one_task, tmp_path: Path
):
    _, _, table = one_task
    cfg = make_config(tmp_path / "work", *SHARDED, "connect.num_tasks=3", "connect.num_workers=0")
    prepare(cfg)
    results = [connect(cfg, task=(rank, 3)) for rank in (2, 0, 1)]
    assert [r.partial for r in results] == [True, True, False]
    pd.testing.assert_frame_equal(_lengths(results[-1]), table)
    with pytest.raises(ValueError, match="connect.num_tasks is 3"):
        connect(cfg, task=(0, 2))


def test_connect_in_a_job_step_of_another_task_count_is_refused(tmp_path: Path, monkeypatch):
    from packline.energon.parts import Task
    from stages.connect import this_task as current_task

    cfg = make_config(tmp_path / "work", *ON_SLURM, "connect.num_tasks=2")
    assert current_task(cfg) is None  # not in a SLURM job: one process, every share
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert current_task(cfg) == Task(1, 2)
    assert current_task(make_config(tmp_path / "local", "connect.num_tasks=2")) is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(UserError) as info:
        current_task(cfg)
    assert "set connect.num_tasks=4" in info.value.problems[0]
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert current_task(cfg) is None


@pytest.mark.slow  # tens of seconds: several loaders or connects
def test_connect_resumes_after_its_last_finished_part_at_any_cut(one_task, tmp_path: Path):
    """A task's parts cut after part k (what a kill leaves: the later parts and the done file
    gone, a torn temp file) resume to the same parts, measuring only the samples after k;
    one cut lies in the share's last samples, where a worker had finished (see
    test_a_restored_share_continues_after_the_saved_sample)."""
    from packline.energon.measure import measure_share
    from packline.energon.parts import PartsDir

    cfg = make_config(tmp_path / "work", *SHARDED, "connect.num_tasks=2", "connect.part_size=3")
    prepare(cfg)
    _, result, _ = one_task
    parts = PartsDir(cfg, "f" * 64)
    m = _measuring(cfg, result.out_dir / "processor", num_workers=2, part_size=3)
    task = parts.task(0)
    whole = measure_share(m, task, attempt="whole")
    keys = [list(pd.read_parquet(path)["key"]) for path, _ in task.finished()]
    assert sum(map(len, keys)) == whole["samples"] == whole["samples_measured"]
    train_parts = [state.split for _, state in task.finished()].count("train")
    for cut in (1, train_parts - 1):
        for path, _ in task.finished()[cut:]:
            path.unlink()
            path.with_suffix(".state").unlink()
        task.done_path.unlink()
        (task.dir / f".task000-part{cut:05d}.parquet.tmp").write_bytes(b"torn")
        resumed = measure_share(m, task, attempt=f"cut{cut}")
        assert resumed["parts_resumed"] == cut
        assert resumed["samples_resumed"] == sum(map(len, keys[:cut]))
        assert resumed["samples_measured"] == whole["samples"] - resumed["samples_resumed"]
        assert [list(pd.read_parquet(path)["key"]) for path, _ in task.finished()] == keys
        assert not list(task.dir.glob(".*.tmp"))


@pytest.mark.slow
def test_connect_killed_after_its_first_part_resumes_to_the_same_table(one_task, tmp_path: Path):
    """``packline stage connect`` SIGKILLed (its whole process group: the loader workers too)
    as soon as its first part is finished; the rerun measures only the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from schemas.config import PROJECT_ROOT
    from stages.base import read_record
    from stages.runner import run_stage

    _, _, table = one_task
    overrides = [f"work_dir={tmp_path / 'work'}", "data.num_train=60", "data.num_val=8"]
    overrides += [*SHARDED, "prepare.num_workers=1", "connect.part_size=5", "mlflow.enabled=false"]
    cfg = make_config(tmp_path / "work", *overrides[1:])
    prepare(cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "stage", "connect", *overrides],
        cwd=PROJECT_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    parts = cfg.work_path / "connect.parts"
    deadline = time.monotonic() + 300
    while not list(parts.glob("*/*/task000-part00000.state")):
        assert proc.poll() is None and time.monotonic() < deadline, "connect ended first"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_record(cfg.work_path, "connect") is None
    (task_dir,) = parts.glob("*/tasks*")
    assert not (task_dir / "task000.done").exists()

    result = run_stage(cfg, "connect")
    m = result.metrics
    assert m["connect/parts_resumed"] >= 1
    assert m["connect/samples_resumed"] == 5 * m["connect/parts_resumed"]
    assert m["connect/samples_measured"] == 68 - m["connect/samples_resumed"]
    pd.testing.assert_frame_equal(_lengths(result), table)
    assert not parts.exists()


def test_connect_verify_a_sample_gives_the_same_table_and_says_so(one_task, tmp_path: Path):
    """``connect.verify: 10``: the processor measures 10 seeded samples, the rest take the
    cheap rule's lengths, the same on the built-in set (videos included); measured as 2 tasks
    in turn by one process."""
    _, _, table = one_task
    cfg = make_config(
        tmp_path / "work", *SHARDED, "connect.verify=10", "connect.num_tasks=2", "train.seed=3"
    )
    prepare(cfg)
    result = connect(cfg)
    assert not result.partial
    pd.testing.assert_frame_equal(_lengths(result), table)
    assert table["num_videos"].sum() > 0
    assert result.metrics["connect/verified_samples"] == 10
    assert result.metrics["connect/verify_all"] == 0
    assert result.summary["verify"] == {"mode": "sample", "samples": 10, "of": 68, "seed": 3}
    record = json.loads((result.out_dir / "_COMPLETE.json").read_text())
    assert record["summary"]["verify"]["mode"] == "sample"
    assert [t["verified_measured"] for t in result.summary["tasks"]] != [0, 0]
    assert sum(t["verified_measured"] for t in result.summary["tasks"]) == 10


@pytest.mark.slow  # tens of seconds: several loaders or connects
def test_connect_verify_a_sample_as_bridge_renders_gives_the_same_outputs(tmp_path: Path):
    """Backend megatron (Bridge's rendering, its pre-sampled video frames): the cheap rule's
    records and Bridge's video report without the processor on all but 5 samples equal
    those of the processor on every one."""
    megatron = (*SHARDED, "train.backend=megatron", "packing.algorithm=ffd")
    out = {}
    for verify in ("all", "5"):
        cfg = make_config(tmp_path / verify, *megatron, f"connect.verify={verify}")
        prepare(cfg)
        result = connect(cfg)
        assert result.metrics["connect/verified_samples"] == (68 if verify == "all" else 5)
        out[verify] = (_lengths(result), (result.out_dir / "bridge_videos.json").read_text())
    pd.testing.assert_frame_equal(out["5"][0], out["all"][0])
    assert out["all"][0]["num_videos"].sum() > 0 and out["5"][1] == out["all"][1]
