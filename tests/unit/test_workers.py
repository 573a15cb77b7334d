"""``ordered_map`` with one item runs it in the calling process whatever the worker count: a
pool takes seconds to start and would hold nothing else. (Several items go to the pool:
``test_prepare_sources`` and ``test_hf_sources`` compare one and two workers byte for byte.)"""

from __future__ import annotations

import os

from packline.workers import ordered_map


def test_a_single_item_is_mapped_in_this_process_without_a_pool():
    started: list[str] = []
    pid = os.getpid()
    # a lambda and a list's method do not pickle: only the calling process can run them
    out = ordered_map(
        lambda _: os.getpid(), iter(["row"]), num_workers=2,
        initializer=started.append, initargs=("set up",),
    )  # fmt: skip
    assert list(out) == [pid] and started == ["set up"]
    assert list(ordered_map(abs, iter([]), num_workers=4)) == []
