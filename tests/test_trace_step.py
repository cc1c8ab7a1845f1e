"""bench/trace_step.py's accounting of a traced step's idle time, on timelines whose answer
is known."""
from bench.trace_step import gap_report

US = 1000  # the timelines are in ns


def test_idle_inside_steps_and_between_steps_and_the_host_lead():
    # two calls of the program: the host launches each in 10 us and returns while the device
    # still runs its kernels; gaps of 1 and 2 us inside a step, 100 us between the steps
    host = [(0, 10 * US, "PjitFunction(forward)"), (0, 10 * US, "PjitFunction(forward)"),
            (2 * US, 3 * US, "cuGraphLaunch (CudaGraph:1)"),
            (200 * US, 210 * US, "PjitFunction(forward)"),
            (201 * US, 202 * US, "cuGraphLaunch (CudaGraph:1)"),
            (150 * US, 160 * US, "PjitFunction(convert_element_type)")]
    dev = [(5 * US, 50 * US, "gemv"), (51 * US, 90 * US, "norm"), (92 * US, 110 * US, "mlp"),
           (210 * US, 260 * US, "gemv"), (261 * US, 300 * US, "norm")]
    rep = gap_report(dev, host)
    assert rep["kernels"] == 5
    assert rep["span_us"] == 295.0
    assert rep["idle_short_us"] == 1.0 + 2.0 + 1.0
    assert rep["idle_long_us"] == 100.0
    assert rep["busy_us"] == 295.0 - 4.0 - 100.0
    assert rep["short_gap_histogram_us"] == {1: 2, 2: 1}
    assert rep["graph_launches"] == 2
    # the first call's device work ends at 110 us, 100 us after its host call returned; the
    # second's at 300 us, 90 us after; the duplicate nested event counts once
    assert rep["host_ahead_us"] == [100.0, 90.0]


def test_overlapping_kernels_leave_no_gap_and_a_late_host_shows_as_negative_lead():
    dev = [(0, 40 * US, "a"), (10 * US, 30 * US, "b"), (41 * US, 45 * US, "c")]
    host = [(0, 60 * US, "PjitFunction(forward)")]
    rep = gap_report(dev, host)
    assert rep["idle_short_us"] == 1.0 and rep["idle_long_us"] == 0.0
    assert rep["host_ahead_us"] == [-15.0]  # the host returned after the device had finished


def test_busy_runs_split_on_long_idle_and_count_overlaps_once():
    from bench.trace_step import busy_runs, kernel_table

    dev = [(0, 40 * US, "gemv(a)"), (10 * US, 30 * US, "norm"), (41 * US, 45 * US, "gemv(b)"),
           (300 * US, 350 * US, "gemv(c)"), (355 * US, 365 * US, "norm")]
    runs = busy_runs(dev, gap_us=100)
    assert [r["kernels"] for r in runs] == [3, 2]
    assert runs[0]["span_us"] == 45.0 and runs[0]["busy_us"] == 44.0  # 40 + 4, overlap once
    assert runs[1]["start_us"] == 300.0 and runs[1]["busy_us"] == 60.0
    table = kernel_table(dev, steps=2)
    assert table[0] == ("gemv", (40 + 4 + 50) / 2, 1.5)
    assert table[1] == ("norm", (20 + 10) / 2, 1.0)


def test_kernel_diff_compares_the_longest_runs_a_step_each():
    from bench.trace_step import kernel_diff

    # a: 2 steps of gemv + norm + add (and an earlier short run that does not count);
    # b: 2 steps of gemv + fused norm
    a = [(0, 5 * US, "warmup")]
    for i in range(2):
        t = 1000 * US + i * 100 * US
        a += [(t, t + 50 * US, "gemv(x)"), (t + 51 * US, t + 55 * US, "norm"),
              (t + 56 * US, t + 58 * US, "add")]
    b = []
    for i in range(2):
        t = i * 100 * US
        b += [(t, t + 50 * US, "gemv(x)"), (t + 51 * US, t + 54 * US, "fused_norm")]
    d = kernel_diff(a, b, marker="gemv", per_step=1)
    assert d["steps"] == [2.0, 2.0]
    assert d["total_us"] == [56.0, 53.0] and d["kernels"] == [3.0, 2.0]
    assert d["rows"][0] == ("norm", 4.0, 0.0, 1.0, 0.0)
    assert d["rows"][1] == ("fused_norm", 0.0, 3.0, 0.0, 1.0)
    assert ("gemv", 50.0, 50.0, 1.0, 1.0) in d["rows"]
    import pytest
    with pytest.raises(ValueError, match="paged_decode"):
        kernel_diff(a, b)
