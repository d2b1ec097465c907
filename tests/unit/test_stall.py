"""The deadline's message (plugin/stall.py): the cores in the order given, the ranks a core
waits for where its PENDING said, and a long rank list cut short."""

from __future__ import annotations

from reduction_appliance.plugin.stall import CoreStall, stall_report


def test_names_each_core_and_the_ranks_it_waits_for() -> None:
    text = stall_report("allreduce round 3 of 256 bytes (FLOAT16, AVG) by rank 1", 2.0, 2.04,
                        3, 4, [CoreStall("appliance core 0", 2, [0, 3]),
                               CoreStall("appliance core 1", 1, None)])
    assert text == (
        "allreduce round 3 of 256 bytes (FLOAT16, AVG) by rank 1 had no result for its "
        "deadline, 2 s (2.0 s in all): 3 of 4 segments unanswered; no answer from appliance "
        "core 0 (2 segments "
        "unanswered; it still waits for ranks [0, 3]), appliance core 1 (1 segment unanswered)"
    )


def test_cores_of_the_same_name_are_each_shown() -> None:
    text = stall_report("round", 1.0, 1.0, 3, 3, [CoreStall("core 0", 1, [2]),
                                                  CoreStall("core 0", 2, None)])
    assert "core 0 (1 segment unanswered; it still waits for ranks [2]), core 0 (2 " in text


def test_a_long_rank_list_is_cut_short() -> None:
    """Runs of ranks as ranges; past 16 runs, how many ranks the rest hold."""
    text = stall_report("round", 1.0, 1.0, 1, 1, [CoreStall("core", 1, list(range(4000)))])
    assert text.endswith("ranks [0-3999])")
    scattered = stall_report("round", 1.0, 1.0, 1, 1,
                             [CoreStall("core", 1, list(range(0, 80, 2)))])
    assert scattered.endswith("ranks [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, "
                              "30, and 24 more])")
    exactly = stall_report("round", 1.0, 1.0, 1, 1,
                           [CoreStall("core", 1, list(range(0, 32, 2)))])
    assert exactly.endswith("28, 30])")
