"""Keep-warm: while the engine is idle, a one-warp spin kernel on a stream of its own keeps the
GPU's clocks up, so the first step of the next request does not pay the clock ramp.

The lane profile's [keep_warm] table sets it: `window_ms` (how long after the last step the GPU
is kept warm; 0 = never), `period_ms` (the host timer's period), `duty` (the fraction of each
period the spin runs) and `grace_ms` (idle time before the first spin, so a burst of requests is
never touched). The engine calls `busy()` before it enqueues a step: the spin in flight sees the
stop flag (host-mapped memory it polls) and returns at once, and no spin is launched until the
engine is `idle()` again and the grace has passed. On a machine without CUDA it does nothing.

The schedule (`Schedule`) is pure logic over an injected clock; `CudaSpin` launches the kernel
through the CUDA driver API (ctypes: no build step, the PTX below is compiled by the driver for
whatever card it runs on)."""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from dataclasses import dataclass

# One warp: spin until the host-mapped stop flag is set or `duration_ns` of %globaltimer passed.
PTX = r"""
.version 7.0
.target sm_75
.address_size 64

.visible .entry ninfer_keep_warm(
    .param .u64 stop_ptr,
    .param .u64 duration_ns
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [stop_ptr];
    ld.param.u64 %rd2, [duration_ns];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u64 %rd3, %globaltimer;
SPIN:
    ld.volatile.global.u32 %r1, [%rd1];
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra DONE;
    mov.u64 %rd4, %globaltimer;
    sub.u64 %rd5, %rd4, %rd3;
    setp.lt.u64 %p2, %rd5, %rd2;
    @%p2 bra SPIN;
DONE:
    ret;
}
"""


class KeepWarmUnavailable(RuntimeError):
    """No CUDA driver or device: keep-warm does nothing here."""


@dataclass(frozen=True)
class KeepWarmConfig:
    window_ms: int = 0
    period_ms: int = 100
    duty: float = 0.1
    grace_ms: int = 500

    def __post_init__(self):
        if self.window_ms < 0 or self.period_ms <= 0 or self.grace_ms < 0:
            raise ValueError("keep-warm window_ms and grace_ms must be >= 0, period_ms > 0")
        if not 0.0 < self.duty <= 1.0:
            raise ValueError(f"keep-warm duty must be in (0, 1], got {self.duty}")

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0

    @property
    def spin_ns(self) -> int:
        return int(self.period_ms * self.duty * 1e6)


class Schedule:
    """When to launch a spin. `now` is the injected clock's seconds."""

    def __init__(self, cfg: KeepWarmConfig, now: float):
        self.cfg = cfg
        self.busy = False
        self.idle_since = now
        self.next_launch = now + cfg.grace_ms / 1e3
        self.launches = 0

    def set_busy(self) -> None:
        self.busy = True

    def set_idle(self, now: float) -> None:
        self.busy = False
        self.idle_since = now
        self.next_launch = now + self.cfg.grace_ms / 1e3

    def due(self, now: float) -> bool:
        """Whether a spin should start now (and, if so, the next one is a period later)."""
        cfg = self.cfg
        if self.busy or not cfg.enabled or now < self.next_launch:
            return False
        if (now - self.idle_since) * 1e3 > cfg.window_ms:
            return False
        self.next_launch = now + cfg.period_ms / 1e3
        self.launches += 1
        return True


class CudaSpin:
    """The spin kernel, loaded into the device's primary context (the one JAX uses)."""

    def __init__(self, device: int = 0):
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            self.cu = ctypes.CDLL(name)
        except OSError as e:
            raise KeepWarmUnavailable(f"no CUDA driver: {e}") from None
        cu = self.cu
        self._check(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self._check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev),
                    "cuDevicePrimaryCtxRetain")
        self.dev = dev
        with self._current():
            self.module = ctypes.c_void_p()
            self._check(cu.cuModuleLoadData(ctypes.byref(self.module), PTX.encode() + b"\0"),
                        "cuModuleLoadData")
            self.fn = ctypes.c_void_p()
            self._check(cu.cuModuleGetFunction(ctypes.byref(self.fn), self.module,
                                               b"ninfer_keep_warm"), "cuModuleGetFunction")
            self.stream = ctypes.c_void_p()
            self._check(cu.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")
            self.flag_host = ctypes.c_void_p()
            # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
            self._check(cu.cuMemHostAlloc(ctypes.byref(self.flag_host), 4, 0x1 | 0x2),
                        "cuMemHostAlloc")
            self.flag_dev = ctypes.c_uint64()
            self._check(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(self.flag_dev),
                                                        self.flag_host, 0),
                        "cuMemHostGetDevicePointer")
        self.flag = ctypes.cast(self.flag_host, ctypes.POINTER(ctypes.c_int32))

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise KeepWarmUnavailable(f"{what} failed (CUresult {rc})")

    def _current(self):
        cu, ctx = self.cu, self.ctx

        class _Ctx:
            def __enter__(self_):
                cu.cuCtxPushCurrent_v2(ctx)

            def __exit__(self_, *exc):
                cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

        return _Ctx()

    def stop(self) -> None:
        """Make the spin in flight (if any) return at once."""
        self.flag[0] = 1

    def launch(self, duration_ns: int) -> None:
        self.flag[0] = 0
        stop = ctypes.c_uint64(self.flag_dev.value)
        dur = ctypes.c_uint64(duration_ns)
        params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(stop), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(dur), ctypes.c_void_p))
        with self._current():
            self._check(self.cu.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, self.stream,
                                               params, None), "cuLaunchKernel")

    def close(self) -> None:
        self.stop()
        with self._current():
            self.cu.cuStreamSynchronize(self.stream)
            self.cu.cuStreamDestroy_v2(self.stream)
            self.cu.cuMemFreeHost(self.flag_host)
            self.cu.cuModuleUnload(self.module)
        self.cu.cuDevicePrimaryCtxRelease_v2(self.dev)


class KeepWarm:
    """The host timer: a daemon thread that launches a spin whenever the schedule says so.
    `spin` is a CudaSpin (or anything with launch/stop/close); None makes every call a no-op."""

    def __init__(self, cfg: KeepWarmConfig, spin=None, clock=time.monotonic):
        self.cfg, self.spin, self.clock = cfg, spin, clock
        self.schedule = Schedule(cfg, clock())
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = None
        if spin is not None and cfg.enabled:
            self._thread = threading.Thread(target=self._run, name="ninfer-keep-warm",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def for_backend(cls, cfg: KeepWarmConfig, backend: str) -> "KeepWarm":
        """Keep-warm on a CUDA device; a no-op elsewhere or when it is off."""
        if backend != "gpu" or not cfg.enabled:
            return cls(cfg)
        try:
            return cls(cfg, CudaSpin())
        except KeepWarmUnavailable:
            return cls(cfg)

    @property
    def launches(self) -> int:
        return self.schedule.launches

    def busy(self) -> None:
        """Before a step is enqueued: no spin runs from here until idle() again."""
        with self._lock:
            self.schedule.set_busy()
            if self.spin is not None:
                self.spin.stop()

    def idle(self) -> None:
        with self._lock:
            self.schedule.set_idle(self.clock())

    def _run(self) -> None:
        while not self._stopped.wait(self.cfg.period_ms / 1e3 / 4):
            with self._lock:
                if self.schedule.due(self.clock()):
                    self.spin.launch(self.cfg.spin_ns)

    def close(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        if self.spin is not None:
            self.spin.close()
