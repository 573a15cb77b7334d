from packline.counters import RunningCounters, layout_metrics, row_fills


def test_layout_metrics_of_packed_rows_count_fill_against_seq_length():
    m = layout_metrics([1536, 1024], conversations=6, padded_tokens=0, seq_length=2048)
    assert m == {
        "pack/rows": 2.0,
        "pack/fill": 2560 / 4096,
        "pack/conversations_per_pack": 3.0,
        "pack/padding_tokens": 0.0,
        "pack/padding_fraction": 0.0,
    }


def test_layout_metrics_when_unpacked_have_one_row_per_conversation_and_count_padding():
    rows = [100, 300, 200]  # one conversation per row, padded to 300 in one micro-batch
    m = layout_metrics(rows, conversations=3, padded_tokens=300, seq_length=1000)
    assert m["pack/rows"] == 3.0 and m["pack/conversations_per_pack"] == 1.0
    assert m["pack/fill"] == 600 / 3000
    assert m["pack/padding_tokens"] == 300.0
    assert m["pack/padding_fraction"] == 300 / 900
    assert row_fills(rows, 1000) == [0.1, 0.3, 0.2]


def test_layout_metrics_of_no_rows_are_zero():
    m = layout_metrics([], conversations=0, padded_tokens=0, seq_length=2048)
    assert set(m.values()) == {0.0}


def test_running_counters_restore_checkpoints_written_before_the_tokens_real_name():
    counters = RunningCounters.fresh()
    counters.load_state_dict({"rows": 2, "real_tokens": 300, "padded_tokens": 4})
    assert (counters.total.rows, counters.total.tokens_real, counters.total.padded_tokens) == (
        2,
        300,
        4,
    )
    assert counters.state_dict()["tokens_real"] == 300
