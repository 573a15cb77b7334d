"""Run in a subprocess with Bridge main's data path on ``PYTHONPATH``
(``tests.bridge_data.bridge_main_tree()``, module files unchanged) and the project root:
packline's dataset for Bridge, built and iterated by Bridge's own code, against Bridge's stock
``QwenVLTaskEncoder`` on the same member samples.

    python bridge_main_packs.py CONFIG_OVERRIDES_JSON OUT_JSON NUM_PACKS

Writes to ``OUT_JSON``: what ``get_dataset_provider`` returned, packline's dataset fields,
per pack its member keys and the names of any batch field that differs from Bridge's stock
encoder's (bitwise), and the keys of the 20 packs after a save/restore of the train loader,
both ways.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def _tensors(batch: dict) -> dict[str, torch.Tensor]:
    """Every tensor of an encoded batch, the visual inputs' fields included."""
    out = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, torch.Tensor):
                    out[f"{name}.{f.name}"] = v
    return out


def _differences(ours: dict, stock: dict) -> list[str]:
    a, b = _tensors(ours), _tensors(stock)
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            bad.append(name)
    if ours.get("__keys__") != stock.get("__keys__"):
        bad.append("__keys__")
    return bad


def main(overrides_file: str, out_file: str, num_packs: int) -> None:
    from megatron.bridge.data.base import DataloaderConfig, DatasetBuildContext, DatasetProvider
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset

    from packline.energon.carry import carried_in
    from packline.megatron.dataset import (
        PacklineEnergonDataset,
        bridge_dataset,
        bridge_stock_encoder,
    )
    from schemas.config import load_config

    cfg = load_config(None, json.loads(open(overrides_file).read()))
    ds = bridge_dataset(cfg)
    ds.finalize()
    own = {f.name for f in dataclasses.fields(PacklineEnergonDataset)}
    own -= {f.name for f in dataclasses.fields(DataloaderConfig)}
    provider = get_dataset_provider(ds)
    report = {
        "is_dataset_provider": isinstance(ds, DatasetProvider),
        "provider": provider.__name__,
        "fields": sorted(own),
        "balance_target": ds.build_task_encoder().balance_target,
    }

    # Bridge's own stock encoder, from Bridge's own builder, on the same settings.
    stock = bridge_stock_encoder(ds)

    # Every train sample as the dataset hands it to an encoder (Bridge's ChatMLWebdataset).
    class Raw(DefaultTaskEncoder):
        def encode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

    raw = {}
    loader = get_loader(
        get_train_dataset(
            ds.path,
            split_part="train",
            batch_size=1,
            task_encoder=Raw(),
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            repeat=False,
        )
    )
    for (sample,) in loader:
        raw[sample.__key__] = sample

    # packline's train loader, through Bridge's protocol adapter and data module.
    context = [num_packs, 0, 0]
    train, _, _ = provider(context, ds, tokenizer=None, pg_collection=None)
    packs = []
    for _ in range(num_packs):
        ours = next(train)
        keys = list(ours["__keys__"])
        members = [stock.encode_sample(raw[k]) for k in keys]
        stock_batch = stock.encode_batch(stock.batch([stock.pack_selected_samples(members)]))
        packs.append(
            {
                "keys": keys,
                "differs": _differences(ours, stock_batch),
                "compared": sorted(_tensors(ours)),
                "lengths": [m.prepared_sequence.sequence_length for m in members],
                "tokens": int(ours["input_ids"].shape[1]),
            }
        )
    report["packs"] = packs

    # Save mid-stream (carried samples waiting), restore in a new data module: same packs.
    first, _, _ = ds.build_datasets(DatasetBuildContext(1, 0, 0))
    for _ in range(30):  # the first save with a sample waiting
        next(first)
        state = first.save_state()
        if carried_in(state):
            break
    report["carried_at_save"] = carried_in(state)
    expected = [list(next(first)["__keys__"]) for _ in range(20)]
    second, _, _ = ds.build_datasets(DatasetBuildContext(1, 0, 0))
    second.restore_state(state)
    report["resumed"] = {
        "expected": expected,
        "got": [list(next(second)["__keys__"]) for _ in range(20)],
    }
    with open(out_file, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
