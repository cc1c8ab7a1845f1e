"""Keep-warm: its schedule over a fake clock, the host timer driving a recording spin, the
no-op on a CPU, and the spin kernel's PTX assembled for every lane's card."""
from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from engine.runtime.keep_warm import PTX, KeepWarm, KeepWarmConfig, Schedule

CFG = KeepWarmConfig(window_ms=60_000, period_ms=100, duty=0.2, grace_ms=500)


def test_schedule_waits_the_grace_then_spins_each_period_within_the_window():
    s = Schedule(CFG, now=0.0)
    assert not s.due(0.0) and not s.due(0.499)
    assert s.due(0.5)
    assert not s.due(0.55)          # one period between spins
    assert s.due(0.6) and s.due(0.7)
    assert s.launches == 3
    # past the window after the last step: no more spins
    assert not s.due(60.0 + 0.1)
    assert CFG.spin_ns == 20_000_000  # duty x period


def test_busy_stops_spinning_until_idle_and_the_grace_again():
    s = Schedule(CFG, now=0.0)
    assert s.due(1.0)
    s.set_busy()
    assert not s.due(5.0) and not s.due(100.0)
    s.set_idle(100.0)
    assert not s.due(100.2)         # grace again after each busy period
    assert s.due(100.5)


def test_off_and_bad_configs():
    off = Schedule(KeepWarmConfig(window_ms=0), now=0.0)
    assert not any(off.due(t / 10) for t in range(100))
    for bad in (dict(duty=0.0), dict(duty=1.5), dict(period_ms=0), dict(window_ms=-1)):
        with pytest.raises(ValueError):
            KeepWarmConfig(**bad)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Spin:
    def __init__(self):
        self.launched, self.stops, self.closed = [], 0, False
        self.event = threading.Event()

    def launch(self, ns):
        self.launched.append(ns)
        self.event.set()

    def stop(self):
        self.stops += 1

    def close(self):
        self.closed = True


def test_the_timer_launches_through_the_spin_and_busy_stops_it():
    clock, spin = _Clock(), _Spin()
    kw = KeepWarm(KeepWarmConfig(window_ms=60_000, period_ms=20, duty=0.5, grace_ms=0),
                  spin, clock)
    try:
        clock.t = 1.0
        assert spin.event.wait(5), "no spin was launched"
        assert spin.launched[0] == 10_000_000
        kw.busy()
        assert spin.stops == 1
        n = len(spin.launched)
        clock.t = 2.0
        threading.Event().wait(0.1)
        assert len(spin.launched) == n  # nothing while busy
    finally:
        kw.close()
    assert spin.closed


def test_a_cpu_backend_makes_keep_warm_a_no_op():
    kw = KeepWarm.for_backend(CFG, "cpu")
    kw.busy()
    kw.idle()
    assert kw.spin is None and kw.launches == 0
    kw.close()


def _ptxas() -> str | None:
    for cand in (shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and Path(cand).is_file():
            return cand
    return None


@pytest.mark.skipif(_ptxas() is None, reason="needs the CUDA toolkit's ptxas")
@pytest.mark.parametrize("arch", ["sm_86", "sm_89", "sm_90", "sm_120"])
def test_the_spin_kernel_assembles_for_every_lane_card(tmp_path, arch):
    src = tmp_path / "keep_warm.ptx"
    src.write_text(PTX)
    out = subprocess.run([_ptxas(), "--gpu-name", arch, "-o", str(tmp_path / "k.cubin"),
                          str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


def test_the_engine_marks_itself_busy_before_a_step_and_idle_after(tiny_model):
    import queue
    import time

    from engine.engine import Engine, GenerationRequest
    from engine.runtime.request import DoneEvent
    from engine.runtime.sampling import SamplingParams

    eng = Engine(tiny_model, context_tokens=512, prefill_chunk=64, keep_warm=CFG)
    eng.start()
    try:
        sched = eng.keep_warm.schedule
        t0 = time.monotonic()
        seen_busy = []
        q: queue.Queue = queue.Queue()

        def emit(ev):
            seen_busy.append(sched.busy)
            q.put(ev)

        eng.submit(GenerationRequest(prompt_ids=[10, 11, 12], sampling=SamplingParams(
            temperature=0), max_tokens=4, stop_ids=frozenset(), emit=emit))
        while not isinstance(q.get(timeout=300), DoneEvent):
            pass
        assert seen_busy and all(seen_busy)  # every token came while marked busy
        for _ in range(200):
            if not sched.busy:
                break
            time.sleep(0.01)
        assert not sched.busy and sched.idle_since > t0
        assert sched.due(sched.idle_since + CFG.grace_ms / 1e3)  # a spin would start
    finally:
        eng.stop()
