"""Carry-over through Energon's real loader (``CarryOverPackingDataset`` under packline's
local encoder): every sample once per epoch, the ledger balanced, and a loader saved with
samples carried over restores to the identical next packs; the same with FLOPs balance,
weighed by connect's per-sample FLOPs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from packline.energon.carry import CarryOverPackingDataset, carried_in
from packline.energon.loader import train_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.packing.ledger import Ledger
from packline.qwen.processor import copy_tiny_processor
from stages.prepare import prepare
from tests.conftest import make_config

warnings.filterwarnings("ignore", message=".*pin_memory.*")
SEQ = 1024
ROWS = 120


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> Path:
    return copy_tiny_processor(tmp_path_factory.mktemp("proc") / "processor")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("carry") / "work"
    return prepare(make_config(work, f"data.num_train={ROWS}", "data.num_val=4")).out_dir


def _loader(dataset, processor_dir, *, carry: int, workers: int = 0, repeat: bool = True):
    settings = PackingSettings(seq_length=SEQ, max_carry_rounds=carry, algorithm="refined")
    encoder = make_encoder("lazy", processor_dir, settings)
    return train_loader(
        dataset, encoder, packing_buffer_size=16, num_workers=workers, repeat=repeat
    )


def _packing_stage(loader) -> CarryOverPackingDataset | None:
    node, seen = loader.dataset, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, CarryOverPackingDataset):
            return node
        inner = getattr(node, "datasets", None)
        node = inner[0] if inner else getattr(node, "dataset", None)
    return None


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_with_carry_over_packs_every_key_once_and_the_ledger_balances(
    dataset, processor_dir, workers
):
    loader = _loader(dataset, processor_dir, carry=4, workers=workers, repeat=False)
    assert _packing_stage(loader) is not None  # build_batch installed the carry-over stage
    ledger, keys, fills = Ledger(), [], []
    for pack in loader:
        b = pack.batch
        ledger.add(seen=b.seen, packed=b.num_conversations, dropped=b.dropped)
        keys += b.keys + [k for ks in b.dropped.values() for k in ks]
        assert b.input_ids.shape[1] <= SEQ
        fills.append(int(b.cu_seqlens[-1]))
    assert len(keys) == len(set(keys)) == ROWS  # nothing lost, nothing twice
    ledger.check()
    assert ledger.seen == ROWS
    plain = _loader(dataset, processor_dir, carry=0, workers=workers, repeat=False)
    assert sum(1 for _ in plain) > len(fills)  # the same tokens in fewer rows


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_saved_with_samples_carried_over_restores_the_identical_next_packs(
    dataset, processor_dir, workers
):
    first = _loader(dataset, processor_dir, carry=4, workers=workers)
    it = iter(first)
    for _ in range(6):
        next(it)
    state = first.save_state_rank()
    assert carried_in(state), "no sample was carried over at the save: the test would prove nothing"
    expected = [next(it) for _ in range(20)]

    second = _loader(dataset, processor_dir, carry=4, workers=workers)
    second.restore_state_rank(state)
    got = [p for p, _ in zip(second, range(20), strict=False)]
    assert [p.batch.keys for p in got] == [p.batch.keys for p in expected]
    for a, b in zip(got, expected, strict=True):
        for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_padded"):
            assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
        if b.batch.pixel_values is not None:
            assert torch.equal(a.batch.pixel_values, b.batch.pixel_values)


def test_flops_balance_through_the_loader_packs_every_key_once_and_resumes_identically(work):
    from packline.catalog import dataset_path, lengths_path
    from packline.catalog import processor_dir as connected_processor
    from tests.integration.train_helpers import SMALL

    def loader(balance: str, repeat: bool):
        cfg = make_config(work, *SMALL, f"packing.balance={balance}", f"packing.seq_length={SEQ}")
        settings = PackingSettings.from_config(cfg.packing, lengths_path=lengths_path(cfg))
        encoder = make_encoder("lazy", connected_processor(cfg), settings)
        assert (encoder.balance is not None) == (balance == "flops")
        return train_loader(dataset_path(cfg), encoder, packing_buffer_size=16, repeat=repeat)

    epoch = [p.batch.keys for p in loader("flops", repeat=False)]
    keys = [k for pack in epoch for k in pack]
    assert len(keys) == len(set(keys)) == 120  # SMALL's train rows: each once
    assert epoch != [p.batch.keys for p in loader("none", repeat=False)]  # balance chose

    first = loader("flops", repeat=True)
    it = iter(first)
    for _ in range(6):
        next(it)
    state = first.save_state_rank()
    assert carried_in(state)
    expected = [next(it).batch.keys for _ in range(10)]
    second = loader("flops", repeat=True)
    second.restore_state_rank(state)
    assert [p.batch.keys for p, _ in zip(second, range(10), strict=False)] == expected
