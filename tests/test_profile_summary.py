"""bench/profile_summary.py's overlap accounting on intervals whose answer is known."""
from bench.profile_summary import exposure


def test_alone_and_overlapped_time_of_chained_kernels():
    # a runs 0-10; b (launched early, as a programmatic dependent launch) runs 8-20 and
    # overlaps a for 2; c runs alone 25-30 after a gap
    got = exposure([("a", 0, 10), ("b", 8, 20), ("c", 25, 30)])
    assert got["a"] == [8.0, 2.0]
    assert got["b"] == [10.0, 2.0]
    assert got["c"] == [5.0, 0.0]


def test_touching_intervals_do_not_overlap_and_repeated_names_add_up():
    got = exposure([("k", 0, 5), ("k", 5, 9), ("m", 2, 3)])
    assert got["k"] == [8.0, 1.0]
    assert got["m"] == [0.0, 1.0]
