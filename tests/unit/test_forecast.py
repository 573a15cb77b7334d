"""The forecast simulator: per-worker streams split as Energon splits them, buffer rounds in
stream order, each backend's selection, and Megatron-Bridge's own first_fit_decreasing (from
the pinned wheel's source, loaded unchanged) giving the same packs per buffer."""

from __future__ import annotations

import doctest
import importlib.util
import subprocess
import sys

import pytest

import packline.packing.forecast as forecast
from packline.bench.lengths import shuffled, vlm_sft_lengths
from packline.packing.forecast import simulate_packing, worker_ranges
from packline.packing.selection import align_up, first_fit_decreasing, select_packs
from tests.bridge_source import IndexUnreachable, fetch_sources

BRIDGE_ALGORITHMS = "megatron/bridge/data/packing/algorithms.py"
BRIDGE_SAFE_PICKLE = "megatron.bridge.utils.safe_pickle"


def test_docstrings_have_worked_examples():  # pytest --doctest-modules runs them
    assert any(test.examples for test in doctest.DocTestFinder().find(forecast))


def test_forecast_module_imports_neither_energon_nor_nemo_run():
    code = (
        "import sys, packline.packing.forecast; "
        "print(sorted(m for m in sys.modules if m.startswith(('megatron', 'nemo_run'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rounds_pack_each_buffer_in_stream_order_with_a_partial_last_buffer():
    # One stream, buffers of 4, capacity 10: [7, 2, 6, 3] → [7, 3], [6, 2]; [5, 5, 4, 4] →
    # [5, 5], [4, 4]; the partial last buffer [9, 1] → [9, 1].
    stream = [7, 2, 6, 3, 5, 5, 4, 4, 9, 1]
    f = simulate_packing(stream, capacity=10, buffer_size=4, algorithm="ffd")
    assert [r.items for r in f.rounds] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [r.groups for r in f.rounds] == [[[0, 3], [2, 1]], [[4, 5], [6, 7]], [[8, 9]]]
    assert f.packs_per_round == [2, 2, 1]
    assert (f.packs, f.samples, f.tokens, f.fill) == (5, 10, 46, 46 / 50)
    assert f.round_bound_packs == 5 and f.dropped == f.skipped == []
    # One buffer of the whole stream: the same 46 tokens in 5 rows, the lower bound
    whole = simulate_packing(stream, capacity=10, buffer_size=10, algorithm="ffd")
    assert whole.packs_per_round == [5]
    # Buffers of 1: one row per sample.
    ones = simulate_packing(stream, capacity=10, buffer_size=1, algorithm="refined")
    assert ones.packs_per_round == [1] * 10 and ones.fill == 46 / 100


def test_plain_and_refined_differ_only_where_refinement_closes_a_row():
    # Per buffer of 6: FFD packs [4, 4, 3, 3, 3, 3] in 3 rows, refined in 2; the second
    # buffer's [6, 4, 5, 5] is already optimal both ways.
    stream = [4, 4, 3, 3, 3, 3, 6, 4, 5, 5]
    ffd = simulate_packing(stream, capacity=10, buffer_size=6, algorithm="ffd")
    bfd = simulate_packing(stream, capacity=10, buffer_size=6, algorithm="bfd")
    refined = simulate_packing(stream, capacity=10, buffer_size=6, algorithm="refined")
    assert ffd.packs_per_round == bfd.packs_per_round == [3, 2]
    assert refined.packs_per_round == [2, 2]
    assert refined.rounds[0].groups == [[0, 2, 3], [1, 4, 5]]
    assert (ffd.fill, refined.fill) == (40 / 50, 1.0)


def test_streams_split_the_samples_into_contiguous_worker_ranges():
    # 2 ranks × 2 workers = 4 streams over 10 samples: 3, 2, 3, 2 (Energon's bit reversal
    # gives the 2 extra samples to workers 0 and 2); buffers of 2 each.
    stream = [6, 5, 4, 3, 2, 7, 1, 8, 3, 3]
    f = simulate_packing(
        stream, capacity=10, buffer_size=2, algorithm="ffd", num_ranks=2, num_workers=2
    )
    assert f.num_streams == 4
    assert [(r.worker, r.items) for r in f.rounds] == [
        (0, [0, 1]),
        (0, [2]),
        (1, [3, 4]),
        (2, [5, 6]),
        (2, [7]),
        (3, [8, 9]),
    ]
    assert f.packs_per_round == [2, 1, 1, 1, 1, 1]
    # num_workers 0 is one in-process stream per rank, as num_workers 1.
    zero = simulate_packing(stream, capacity=10, buffer_size=2, algorithm="ffd", num_ranks=3)
    one = simulate_packing(
        stream, capacity=10, buffer_size=2, algorithm="ffd", num_ranks=3, num_workers=1
    )
    assert zero.num_streams == one.num_streams == 3
    assert [r.items for r in zero.rounds] == [r.items for r in one.rounds]
    assert [r.worker for r in zero.rounds] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("num_samples", "num_ranks", "num_workers"),
    [(10, 1, 0), (10, 2, 2), (1000, 8, 4), (37, 3, 5), (3, 4, 2), (0, 2, 1), (2001, 16, 2)],
)
def test_worker_ranges_equal_energons_split(num_samples, num_ranks, num_workers):
    from megatron.energon import WorkerConfig
    from megatron.energon.flavors.webdataset.sharder import Sharder

    energon: list[tuple[int, int]] = []
    for rank in range(num_ranks):
        wc = WorkerConfig(rank=rank, world_size=num_ranks, num_workers=num_workers)
        offsets = Sharder.split_samples_to_workers(0, num_samples, wc)
        energon += list(zip(offsets, offsets[1:], strict=False))
    assert worker_ranges(num_samples, num_ranks * max(num_workers, 1)) == energon


def test_overlength_takes_a_slot_locally_and_is_skipped_before_bridges_buffer():
    # Capacity 10, buffers of 2: locally the 11 and the 12 fill the first buffer and are
    # dropped; Bridge's encoder raises on them before the buffer, so its buffers are [3, 4]
    # and [5].
    stream = [11, 12, 3, 4, 5]
    local = simulate_packing(stream, capacity=10, buffer_size=2, algorithm="ffd")
    assert [r.items for r in local.rounds] == [[0, 1], [2, 3], [4]]
    assert local.packs_per_round == [0, 1, 1] and local.dropped == [0, 1]
    bridge = simulate_packing(
        stream, capacity=10, buffer_size=2, algorithm="ffd", backend="megatron"
    )
    assert [r.items for r in bridge.rounds] == [[2, 3], [4]]
    assert bridge.packs_per_round == [1, 1] and bridge.skipped == [0, 1]
    assert local.fill == bridge.fill == 12 / 20


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_carry_rounds must be >= 0"):
        simulate_packing([1], capacity=4, buffer_size=1, algorithm="ffd", max_carry_rounds=-1)
    with pytest.raises(ValueError, match="unknown packing algorithm 'greedy'"):
        simulate_packing([1], capacity=4, buffer_size=1, algorithm="greedy")
    with pytest.raises(ValueError, match="unknown train backend 'nemo'"):
        simulate_packing([1], capacity=4, buffer_size=1, algorithm="ffd", backend="nemo")
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        simulate_packing([1], capacity=4, buffer_size=0, algorithm="ffd")
    assert simulate_packing([], capacity=4, buffer_size=3, algorithm="ffd").fill == 0.0


def test_rounds_cover_every_sample_once_and_match_select_packs_per_buffer():
    lengths = [align_up(n, 4) for n in shuffled(vlm_sft_lengths(3000, seed=3), 1)]
    for algorithm in ("ffd", "bfd", "refined"):
        f = simulate_packing(
            lengths, capacity=2048, buffer_size=64, algorithm=algorithm, num_ranks=2, num_workers=3
        )
        packed = sorted(i for r in f.rounds for g in r.groups for i in g)
        assert sorted(packed + f.dropped) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= 2048 for r in f.rounds for g in r.groups)
        for worker, (start, end) in enumerate(worker_ranges(len(lengths), 6)):
            sizes = [len(r.items) for r in f.rounds if r.worker == worker]
            assert sizes == [64] * ((end - start) // 64) + [(end - start) % 64] * (
                (end - start) % 64 > 0
            )
        for r in f.rounds:
            fits = [i for i in r.items if lengths[i] <= 2048]
            expected = select_packs(
                [lengths[i] for i in fits], capacity=2048, algorithm=algorithm, seed=None
            )
            assert r.groups == [[fits[j] for j in g] for g in expected]
        assert f.packs <= f.samples and f.round_bound_packs <= f.packs


@pytest.fixture(scope="module")
def bridge_first_fit_decreasing():
    """``first_fit_decreasing`` of the pinned megatron-bridge wheel's
    ``data/packing/algorithms.py``, the module file loaded unchanged. It imports
    ``megatron.bridge.utils.safe_pickle``: the wheel's own file is loaded under that name for
    the import and taken out of ``sys.modules`` again (Bridge's package ``__init__``, which
    needs transformer-engine, is never run)."""
    try:
        src = fetch_sources()
    except IndexUnreachable as exc:
        pytest.skip(f"cannot download the pinned Megatron-Bridge wheels from the index: {exc}")
    saved = sys.modules.get(BRIDGE_SAFE_PICKLE)
    spec = importlib.util.spec_from_file_location(
        BRIDGE_SAFE_PICKLE, src / "megatron/bridge/utils/safe_pickle.py"
    )
    safe_pickle = importlib.util.module_from_spec(spec)
    sys.modules[BRIDGE_SAFE_PICKLE] = safe_pickle
    try:
        spec.loader.exec_module(safe_pickle)
        spec = importlib.util.spec_from_file_location(
            "bridge_packing_algorithms", src / BRIDGE_ALGORITHMS
        )
        algorithms = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(algorithms)
    finally:
        if saved is None:
            del sys.modules[BRIDGE_SAFE_PICKLE]
        else:
            sys.modules[BRIDGE_SAFE_PICKLE] = saved
    assert algorithms.safe_load_npy is safe_pickle.safe_load_npy  # the real one, imported
    return algorithms.first_fit_decreasing


def test_bridge_first_fit_decreasing_itself_is_plain_ffd(bridge_first_fit_decreasing):
    # Bridge returns bins of lengths; packline's groups of indices give the same bins.
    for lengths in ([6, 5, 4, 3, 2], [4, 4, 3, 3, 3, 3], [8, 5, 6, 8, 7, 9, 6, 9], [7, 4, 4, 2]):
        capacity = 20 if max(lengths) > 7 else 10
        ours = [[lengths[i] for i in g] for g in first_fit_decreasing(lengths, capacity)]
        assert bridge_first_fit_decreasing(lengths, capacity) == ours
    assert bridge_first_fit_decreasing([4, 4, 3, 3, 3, 3], 10) == [[4, 4], [3, 3, 3], [3]]


@pytest.mark.parametrize(
    ("buffer_size", "num_ranks", "num_workers", "alignment"),
    [(8, 1, 0, 1), (16, 2, 2, 4), (64, 4, 1, 8), (256, 1, 2, 1)],
)
def test_bridge_packs_per_buffer_equal_the_megatron_forecast(
    bridge_first_fit_decreasing, buffer_size, num_ranks, num_workers, alignment
):
    capacity = 4096
    raw = shuffled(vlm_sft_lengths(6000, seed=11), 2)  # a few over 4096: Bridge skips them
    aligned = [align_up(n, alignment) for n in raw]
    f = simulate_packing(
        aligned,
        capacity=capacity,
        buffer_size=buffer_size,
        algorithm="ffd",
        backend="megatron",
        num_ranks=num_ranks,
        num_workers=num_workers,
    )
    assert f.skipped and len(f.rounds) > 10
    bridge = [
        bridge_first_fit_decreasing([aligned[i] for i in r.items], capacity) for r in f.rounds
    ]
    assert f.packs_per_round == [len(bins) for bins in bridge]
    # ... and the very same bins, in Bridge's order.
    assert [[[aligned[i] for i in g] for g in r.groups] for r in f.rounds] == bridge


#: Per-sample FLOPs handed to forecast_settings: they reach the simulation only with balance.
COSTS = [1.0, 2.0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [],
            {
                "backend": "local",
                "algorithm": "refined",
                "max_carry_rounds": 4,
                "costs": None,
                "num_ranks": 1,
                "num_workers": 0,
            },
        ),
        (
            [
                "train.nproc_per_node=2",
                "train.num_workers=3",
                "packing.algorithm=bfd",
                "packing.max_carry_rounds=0",
            ],
            {
                "backend": "local",
                "algorithm": "bfd",
                "max_carry_rounds": 0,
                "costs": None,
                "num_ranks": 2,
                "num_workers": 3,
            },
        ),
        (  # the local backend on SLURM: every process of the train job is a DP rank
            ["executor.kind=slurm", "executor.slurm.nodes=2", "executor.slurm.nproc_per_node=2"],
            {
                "backend": "local",
                "algorithm": "refined",
                "max_carry_rounds": 4,
                "costs": None,
                "num_ranks": 4,
                "num_workers": 0,
            },
        ),
        (  # Bridge with packline's packer, FLOPs-balanced: 2 nodes × 8 GPUs over TP 2 × CP 2
            [
                "train.backend=megatron",
                "packing.balance=flops",
                "executor.slurm.nodes=2",
                "packing.tensor_parallel=2",
                "packing.context_parallel=2",
                "train.num_workers=2",
            ],
            {
                "backend": "megatron",
                "algorithm": "refined",
                "max_carry_rounds": 4,
                "costs": COSTS,
                "num_ranks": 4,
                "num_workers": 2,
            },
        ),
        (  # Bridge's own packer: plain FFD without carry-over or balance whatever the config says
            ["train.backend=megatron", "packing.packer=bridge", "packing.balance=flops"],
            {
                "backend": "megatron",
                "algorithm": "ffd",
                "max_carry_rounds": 0,
                "costs": None,
                "num_ranks": 8,
                "num_workers": 0,
            },
        ),
    ],
)
def test_forecast_settings_follow_the_train_backend(overrides, expected):
    from packline.forecast import forecast_settings
    from schemas.config import load_config

    assert forecast_settings(load_config(None, overrides), COSTS) == expected


@pytest.mark.parametrize("backend", ["local", "megatron"])
@pytest.mark.parametrize("buffer_size", [3, 16, 64])
def test_carry_over_emits_every_sample_once_and_no_sample_waits_longer_than_allowed(
    backend, buffer_size
):
    lengths = [align_up(n, 4) for n in shuffled(vlm_sft_lengths(1500, seed=5), 2)]
    capacity, max_rounds = 2048, 3
    f = simulate_packing(
        lengths,
        capacity=capacity,
        buffer_size=buffer_size,
        algorithm="refined",
        backend=backend,
        num_ranks=2,
        num_workers=2,
        max_carry_rounds=max_rounds,
    )
    emitted = [i for r in f.rounds for g in r.groups for i in g]
    fits = [i for i, n in enumerate(lengths) if n <= capacity]
    assert sorted(emitted) == fits  # each fitting sample exactly once
    assert sorted(f.dropped + f.skipped) == [i for i, n in enumerate(lengths) if n > capacity]
    assert all(sum(lengths[i] for i in g) <= capacity for r in f.rounds for g in r.groups)
    # a sample is in the buffer of at most max_rounds + 1 rounds of its worker
    rounds_in = {}
    for r in f.rounds:
        for i in r.items:
            rounds_in[i] = rounds_in.get(i, 0) + 1
        assert len(r.items) <= buffer_size and r.groups  # every round emits
        carried_next = set(r.carried)
        assert not carried_next & {i for g in r.groups for i in g}
    assert max(rounds_in.values()) <= max_rounds + 1
    # (how much fuller the rows are is a benchmark figure: packline bench packing)


def test_rank_packs_take_each_ranks_workers_in_turn_and_the_straggler_ratio_reads_steps():
    from packline.packing.forecast import rank_packs, straggler_ratio

    # 8 samples of 5 over 2 ranks × 2 workers, capacity 10, buffers of 1: one pack per sample,
    # worker w of rank r holds positions 2·(2r + w), +1
    f = simulate_packing([5] * 8, capacity=10, buffer_size=1, algorithm="ffd", num_ranks=2,
                         num_workers=2)  # fmt: skip
    assert rank_packs(f, 2) == [[[0], [2], [1], [3]], [[4], [6], [5], [7]]]
    costs = [1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0]
    # steps of 2 packs: rank 1's first step costs 4 against rank 0's 2 → 4 / 3; then 2 / 2
    assert straggler_ratio(f, costs, num_ranks=2, packs_per_step=2) == pytest.approx(
        (4 / 3 + 1) / 2
    )
    assert straggler_ratio(f, costs, num_ranks=2, packs_per_step=5) == 1.0  # no whole step
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        rank_packs(f, 3)
