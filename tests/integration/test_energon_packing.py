"""Energon-native packing on real prepared datasets: nothing lost, resumable, lazy == eager."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from packline.energon.loader import train_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.packing.ledger import Ledger
from packline.qwen.processor import copy_tiny_processor
from stages.prepare import prepare
from tests.conftest import make_config

warnings.filterwarnings("ignore", message=".*pin_memory.*")
SEQ = 2048
# Enough rows for each of 2 loader workers to fill the largest buffer (256) twice, and they
# hold row 210, the built-in set's one train conversation longer than SEQ (2,091 tokens).
EPOCH_ROWS = 1200


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> Path:
    return copy_tiny_processor(tmp_path_factory.mktemp("proc") / "processor")


@pytest.fixture(scope="module")
def default_dataset(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("default") / "work"
    cfg = make_config(
        work, f"data.num_train={EPOCH_ROWS}", "data.num_val=20", "prepare.num_workers=2"
    )
    return prepare(cfg).out_dir


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("small") / "work"
    cfg = make_config(work, "data.num_train=50", "data.num_val=4")
    return prepare(cfg).out_dir


def _epoch(dataset, processor_dir, *, buffer, workers, mode="lazy", seq=SEQ):
    encoder = make_encoder(mode, processor_dir, PackingSettings(seq_length=seq))
    loader = train_loader(
        dataset, encoder, packing_buffer_size=buffer, num_workers=workers, repeat=False
    )
    return list(loader)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("buffer", [1, 16, 256])
def test_one_epoch_yields_every_key_once_and_the_ledger_balances(
    default_dataset, processor_dir, buffer, workers
):
    packs = _epoch(default_dataset, processor_dir, buffer=buffer, workers=workers)
    ledger = Ledger()
    keys = []
    for pack in packs:
        b = pack.batch
        ledger.add(seen=b.seen, packed=b.num_conversations, dropped=b.dropped)
        keys += b.keys + [k for ks in b.dropped.values() for k in ks]
        assert b.input_ids.shape[1] <= SEQ
    assert len(keys) == len(set(keys)) == EPOCH_ROWS  # every key exactly once
    ledger.check()
    assert ledger.seen == EPOCH_ROWS
    assert ledger.dropped == {"overlength": 1}  # the one conversation longer than 2048
    if buffer == 1:  # one conversation per row; the dropped one rides in an empty row
        assert sum(p.batch.num_conversations == 1 for p in packs) == EPOCH_ROWS - 1
        empty = [p.batch for p in packs if p.batch.num_conversations == 0]
        assert len(empty) == 1 and list(empty[0].dropped) == ["overlength"]


def test_lazy_and_eager_build_identical_packs(small_dataset, processor_dir):
    lazy = _epoch(small_dataset, processor_dir, buffer=16, workers=0, mode="lazy")
    eager = _epoch(small_dataset, processor_dir, buffer=16, workers=0, mode="eager")
    assert [p.batch.keys for p in lazy] == [p.batch.keys for p in eager]
    for a, b in zip(lazy, eager, strict=True):
        assert torch.equal(a.batch.input_ids, b.batch.input_ids)
        assert torch.equal(a.batch.labels, b.batch.labels)
        assert torch.equal(a.batch.position_ids, b.batch.position_ids)
        if a.batch.pixel_values is not None:
            assert torch.equal(a.batch.pixel_values, b.batch.pixel_values)


def test_finite_stream_flushes_its_partial_buffer(small_dataset, processor_dir):
    packs = _epoch(small_dataset, processor_dir, buffer=16, workers=0, seq=1024)
    keys = [k for p in packs for k in p.batch.keys + sum(p.batch.dropped.values(), [])]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 50  # 50 = 3 × 16 + 2


@pytest.mark.parametrize("workers", [0, 2])
def test_restored_loader_continues_with_identical_packs(small_dataset, processor_dir, workers):
    settings = PackingSettings(seq_length=1024)

    def loader():
        enc = make_encoder("lazy", processor_dir, settings)
        return train_loader(small_dataset, enc, packing_buffer_size=16, num_workers=workers)

    first = loader()
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.save_state_rank()
    expected = [next(it) for _ in range(5)]

    second = loader()
    second.restore_state_rank(state)
    got = [p for p, _ in zip(second, range(5), strict=False)]
    assert [p.batch.keys for p in got] == [p.batch.keys for p in expected]
    for a, b in zip(got, expected, strict=True):
        for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_padded"):
            assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
        if b.batch.pixel_values is not None:
            assert torch.equal(a.batch.pixel_values, b.batch.pixel_values)


def test_overlength_policy_fail_stops_with_the_sample_named(small_dataset, processor_dir):
    from megatron.energon.errors import FatalSampleError

    encoder = make_encoder("lazy", processor_dir, PackingSettings(seq_length=64, overlength="fail"))
    loader = train_loader(small_dataset, encoder, packing_buffer_size=4, repeat=False)
    with pytest.raises(FatalSampleError, match="packing.overlength is 'fail'"):
        next(iter(loader))


def test_batch_refuses_more_than_one_row(processor_dir):
    encoder = make_encoder("lazy", processor_dir, PackingSettings(seq_length=64))
    with pytest.raises(ValueError, match="exactly one row, got 2"):
        encoder.batch([object(), object()])


def _corrupt_images(dataset: Path, keys: set[str] | None = None) -> int:
    """Overwrite image bytes inside the shards in place (same size, so the index holds)."""
    import tarfile

    n = 0
    for shard in sorted(dataset.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            members = [m for m in tar.getmembers() if ".img" in m.name]
        with open(shard, "r+b") as f:
            for m in members:
                if keys is None or m.name.split(".")[0] in keys:
                    f.seek(m.offset_data)
                    f.write(b"\0" * m.size)
                    n += 1
    return n


def test_a_malformed_sample_is_a_counted_skip(tmp_path, processor_dir):
    dataset = prepare(make_config(tmp_path / "work", "data.num_train=30", "data.num_val=2")).out_dir
    manifest = __import__("pandas").read_parquet(dataset / "manifest.parquet")
    victim = manifest[(manifest.split == "train") & (manifest.num_images > 0)].key.iloc[0]
    assert _corrupt_images(dataset, {victim}) >= 1
    packs = _epoch(dataset, processor_dir, buffer=8, workers=0)
    ledger = Ledger()
    for p in packs:
        ledger.add(seen=p.batch.seen, packed=p.batch.num_conversations, dropped=p.batch.dropped)
    ledger.check()
    assert ledger.seen == 30 and ledger.packed == 29
    assert dict(ledger.dropped) == {"malformed": 1}
    assert victim in sum((p.batch.dropped.get("malformed", []) for p in packs), [])


def test_all_samples_malformed_stops_instead_of_looping(tmp_path, processor_dir):
    """Energon's bounded failure tolerance ends a stream of nothing but bad samples."""
    from megatron.energon.errors import FatalSampleError

    from tests.integration.test_prepare import _png, _row

    folder = tmp_path / "data"
    rows = [_row(f"r{i}", [_png(folder / f"{i}.png", (64, 64 + 8 * i))]) for i in range(6)]
    (folder / "conversations.jsonl").write_text("\n".join(rows) + "\n")
    cfg = make_config(tmp_path / "work", f"data.source={folder}", "prepare.val_fraction=0")
    dataset = prepare(cfg).out_dir
    assert _corrupt_images(dataset) == 6
    encoder = make_encoder("lazy", processor_dir, PackingSettings(seq_length=1024))
    loader = train_loader(dataset, encoder, packing_buffer_size=4, repeat=True)
    with pytest.raises(FatalSampleError):
        next(iter(loader))


def test_counters_after_save_and_restore_equal_an_uninterrupted_run(small_dataset, processor_dir):
    from packline.counters import PackCounts, RunningCounters, flops_model_for
    from packline.qwen.processor import load_processor
    from schemas.config import load_config

    model = flops_model_for(load_config(), load_processor(processor_dir))
    settings = PackingSettings(seq_length=1024)

    def loader():
        return train_loader(
            small_dataset, make_encoder("lazy", processor_dir, settings), packing_buffer_size=16
        )

    def count(it, counters, n):
        for _ in range(n):
            counters.add(PackCounts.of(next(it).batch, model, 1024))

    straight = RunningCounters.fresh()
    count(iter(loader()), straight, 10)

    first, interrupted = loader(), RunningCounters.fresh()
    count(iter(first), interrupted, 4)
    saved = (first.save_state_rank(), interrupted.state_dict())
    resumed_loader, resumed = loader(), RunningCounters.fresh()
    resumed_loader.restore_state_rank(saved[0])
    resumed.load_state_dict(saved[1])
    count(iter(resumed_loader), resumed, 6)
    assert resumed.total == straight.total
    assert straight.total.rows == 10 and straight.total.flops_useful > 0
