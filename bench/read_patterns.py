"""How fast can one GPU *read* HBM, for each way a decode GEMV might walk its weights?

The int4 GEMV kernels (engine/kernels/cuda/int4_gemv.cu) stop near 2.1 TB/s of weight bytes
while a device copy moves 4.2 TB/s (read + write counted). This isolates the memory side:
kernels that only read a 1 GiB buffer and fold it into a checksum, no arithmetic to speak of,
each with one access pattern:

- ``stream``: every thread walks the whole buffer with a grid-wide stride (a copy's pattern).
- ``rows R U``: the GEMV pattern: a row-major [N, row_bytes] matrix, a warp owns R rows,
  lane l reads 16-byte chunks l, l + 32, ... of each, U chunks a row in flight.
- ``tiles``: a block owns ``rows_per_block`` consecutive rows (one contiguous span) and its
  threads read the span front to back, 16 bytes each, in lockstep.
- ``rows_alu W``: the GEMV pattern with W FFMAs per 32-bit word loaded: the arithmetic a byte
  can carry before the issue rate, not the HBM, sets the pace.
- ``rows_scales``: the GEMV pattern plus a second stream, one fp32 per 64 codes (the scales).
- ``mma W S``: the tensor-core kernels' pattern: a block of 8 warps owns 16 rows; warp w
  takes groups (32 bytes of a row) w, w + 8, ...; lane (g, t) = (lane / 4, lane % 4) loads
  W bytes of row g and of row g + 8 (W = 8: its 16 codes of one group, one LDG.64 covering 8
  rows; W = 16: 2 groups a load, 64 bytes a row), 4 loads in flight; S = 1: plus the two rows'
  fp32 scales of each group (a third and fourth load, 8 rows each). One warp instruction
  touches 8 rows, where ``rows`` touches one: is the L1's per-line work, not the HBM, the cap?

with the cache hints the kernels use (``.nc.L1::no_allocate``) or none, and an L2 prefetch hint.
Run on the GPU machine (CuPy from the image):

    python3 bench/read_patterns.py --out read_patterns.json
"""
from __future__ import annotations

import argparse
import json
import time

import cupy as cp

SRC = r"""
#define LOAD(p) load(p)
template <int HINT>
__device__ __forceinline__ uint4 load(const uint4* p) {
  uint4 v;
  if (HINT == 0) {
    v = *p;
  } else if (HINT == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

template <int HINT, int U>
__device__ void stream(const uint4* buf, long long n16, unsigned* out) {
  long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load<HINT>(buf + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  for (; i < n16; i += stride) acc ^= fold(load<HINT>(buf + i));
  if (acc == 0x12345678u) out[0] = acc;
}

// The GEMV pattern over [n_rows, row16] uint4s: warp w owns rows w*R .. w*R+R-1, and lane l
// loads chunks c0 + l, c0 + l + 32, ... (U of them) of each of its rows at once.
__device__ __forceinline__ int first_row(int r_per_warp) {
  return (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * r_per_warp;
}

template <int HINT, int R, int U>
__device__ __forceinline__ void load_rows(const uint4* buf, int n_rows, int row16, int row0,
                                          int c0, uint4 (&v)[R][U]) {
  int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      int c = c0 + u * 32 + lane;
      int row = min(row0 + r, n_rows - 1);
      v[r][u] = c < row16 ? load<HINT>(buf + (long long)row * row16 + c) : make_uint4(0,0,0,0);
    }
}

template <int HINT, int R, int U>
__device__ void rows(const uint4* buf, int n_rows, int row16, unsigned* out) {
  int row0 = first_row(R);
  if (row0 >= n_rows) return;
  unsigned acc = 0;
  for (int c0 = 0; c0 < row16; c0 += 32 * U) {
    uint4 v[R][U];
    load_rows<HINT, R, U>(buf, n_rows, row16, row0, c0, v);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) acc ^= fold(v[r][u]);
  }
  if (acc == 0x12345678u) out[0] = acc;
}

// block b reads span [b * span16, (b + 1) * span16) front to back.
template <int HINT, int U>
__device__ void tiles(const uint4* buf, long long n16, int span16, unsigned* out) {
  long long base = (long long)blockIdx.x * span16;
  unsigned acc = 0;
  for (int c0 = threadIdx.x; c0 < span16; c0 += U * blockDim.x) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      long long c = base + c0 + u * blockDim.x;
      v[u] = (c0 + u * blockDim.x < span16 && c < n16) ? load<HINT>(buf + c) : make_uint4(0,0,0,0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  if (acc == 0x12345678u) out[0] = acc;
}

// The GEMV pattern (R = 2 rows a warp, U = 4 chunks a row in flight) with WORK dependent-free
// FFMAs per 32-bit word loaded (8 codes): how much arithmetic a byte can carry before the
// issue rate, not the HBM, sets the pace. The int4 `fma` kernel does ~3.6 instructions a
// code, ~29 a word; WORK = 0 is the plain read.
template <int WORK>
__device__ void rows_alu(const uint4* buf, int n_rows, int row16, unsigned* out) {
  constexpr int R = 2, U = 4;
  int row0 = first_row(R);
  if (row0 >= n_rows) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = 0; c0 < row16; c0 += 32 * U) {
    uint4 v[R][U];
    load_rows<1, R, U>(buf, n_rows, row16, row0, c0, v);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned w[4] = {v[r][u].x, v[r][u].y, v[r][u].z, v[r][u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float f = __uint_as_float((w[i] & 0x007FFFFFu) | 0x3F800000u);
#pragma unroll
          for (int k = 0; k < WORK; ++k) acc[k & 3] = fmaf(f, acc[k & 3], f);
        }
      }
  }
  if (acc[0] + acc[1] + acc[2] + acc[3] == 1234.5f) out[0] = 1;
}

// The GEMV pattern plus the second stream a quantized GEMV reads: one fp32 scale per 64 codes
// (1/8 of the code bytes, its own array), 4 bytes a lane per 16-byte chunk pair.
__device__ void rows_scales(const uint4* buf, const float* scales, int n_rows, int row16,
                            unsigned* out) {
  constexpr int R = 2, U = 4;
  int lane = threadIdx.x & 31;
  int row0 = first_row(R);
  if (row0 >= n_rows) return;
  unsigned acc = 0;
  float sacc = 0.f;
  for (int c0 = 0; c0 < row16; c0 += 32 * U) {
    uint4 v[R][U];
    float sv[R][U];
    load_rows<1, R, U>(buf, n_rows, row16, row0, c0, v);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        int c = c0 + u * 32 + lane;
        int row = min(row0 + r, n_rows - 1);
        sv[r][u] = c < row16 ? __ldg(scales + (long long)row * (row16 / 2) + (c >> 1)) : 0.f;
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc ^= fold(v[r][u]);
        sacc += sv[r][u];
      }
  }
  if (acc == 0x12345678u || sacc == 1234.5f) out[0] = acc;
}

// The tensor-core kernels' pattern (see the module docstring): 16-row tiles, lanes (g, t).
template <int W, int S>
__device__ void mma_tile(const unsigned char* buf, const float* scales, int n_rows,
                         int row_bytes, unsigned* out) {
  constexpr int P = 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  if (row0 >= n_rows) return;
  const int ra = min(row0 + g, n_rows - 1), rb = min(row0 + g + 8, n_rows - 1);
  const int step = 32 * W / 8;  // bytes of a row one load of the warp covers
  const int pieces = row_bytes / step;
  const unsigned char* pa = buf + (long long)ra * row_bytes + warp * step + t * W;
  const unsigned char* pb = buf + (long long)rb * row_bytes + warp * step + t * W;
  const int sgroups = row_bytes / 32;
  const float* qa = scales + (long long)ra * sgroups + warp * (W / 8);
  const float* qb = scales + (long long)rb * sgroups + warp * (W / 8);
  unsigned acc = 0;
  float sacc = 0.f;
  for (int i0 = warp; i0 < pieces; i0 += 8 * P) {
    uint4 va[P], vb[P];
    float sa[P], sb[P];
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int i = i0 + 8 * j;
      const long long off = (long long)(i - warp) * step;
      if (i < pieces) {
        if (W == 8) {
          uint2 a, b;
          asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
                       : "=r"(a.x), "=r"(a.y) : "l"(pa + off));
          asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
                       : "=r"(b.x), "=r"(b.y) : "l"(pb + off));
          va[j] = make_uint4(a.x, a.y, 0, 0);
          vb[j] = make_uint4(b.x, b.y, 0, 0);
        } else {
          va[j] = load<1>(reinterpret_cast<const uint4*>(pa + off));
          vb[j] = load<1>(reinterpret_cast<const uint4*>(pb + off));
        }
        if (S) {
          sa[j] = __ldg(qa + (i - warp) * (W / 8));
          sb[j] = __ldg(qb + (i - warp) * (W / 8));
        } else {
          sa[j] = sb[j] = 0.f;
        }
      } else {
        va[j] = vb[j] = make_uint4(0, 0, 0, 0);
        sa[j] = sb[j] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < P; ++j) {
      acc ^= fold(va[j]) ^ fold(vb[j]);
      sacc += sa[j] + sb[j];
    }
  }
  if (acc == 0x12345678u || sacc == 1234.5f) out[0] = acc;
}

extern "C" {
#define MMA(W, S) __global__ void mma_w##W##_s##S(const unsigned char* b, const float* s, int n, int rb, unsigned* o) { mma_tile<W, S>(b, s, n, rb, o); }
MMA(8, 0) MMA(8, 1) MMA(16, 0) MMA(16, 1)
#define ALU(W) __global__ void rows_alu_w##W(const uint4* b, int n, int r16, unsigned* o) { rows_alu<W>(b, n, r16, o); }
ALU(0) ALU(8) ALU(16) ALU(24) ALU(32) ALU(48)
__global__ void rows_scales_k(const uint4* b, const float* s, int n, int r16, unsigned* o) { rows_scales(b, s, n, r16, o); }
#define STREAM(H, U) __global__ void stream_h##H##_u##U(const uint4* b, long long n, unsigned* o) { stream<H, U>(b, n, o); }
STREAM(0, 4) STREAM(1, 4) STREAM(2, 4) STREAM(1, 8)
#define ROWS(H, R, U) __global__ void rows_h##H##_r##R##_u##U(const uint4* b, int n, int r16, unsigned* o) { rows<H, R, U>(b, n, r16, o); }
ROWS(0, 1, 4) ROWS(1, 1, 4) ROWS(2, 1, 4) ROWS(1, 2, 4) ROWS(1, 2, 2) ROWS(1, 4, 2) ROWS(1, 1, 8) ROWS(2, 2, 4)
#define TILES(H, U) __global__ void tiles_h##H##_u##U(const uint4* b, long long n, int s16, unsigned* o) { tiles<H, U>(b, n, s16, o); }
TILES(1, 2) TILES(1, 4) TILES(2, 4) TILES(1, 8)
}
"""


def timeit(fn, reps: int = 10) -> float:
    fn()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--row-bytes", default="2560,8704", help="K/2 of the int4 matrices: "
                    "5120 (hidden) and 17408 (MLP) inputs")
    ap.add_argument("--out", default="read_patterns.json")
    args = ap.parse_args()
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=None)
    n_bytes = int(args.gib * (1 << 30)) // 65536 * 65536
    buf = cp.random.randint(0, 2 ** 31, size=n_bytes // 4, dtype=cp.int32)
    out = cp.zeros(4, cp.uint32)
    n16 = n_bytes // 16
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    res = {"date": time.strftime("%Y-%m-%d"), "device": cp.cuda.runtime.getDeviceProperties(0)[
        "name"].decode(), "bytes": n_bytes, "sms": sms, "rows": []}

    dst = cp.empty_like(buf)
    t = timeit(lambda d=dst: cp.copyto(d, buf))
    res["copy_read_plus_write_TBps"] = 2 * n_bytes / t / 1e12
    print(f"{'cupy copy (read+write counted)':>40}: {t * 1e6:8.1f} us "
          f"{2 * n_bytes / t / 1e12:5.2f} TB/s", flush=True)
    del dst

    def report(name, fn):
        t = timeit(fn)
        bw = n_bytes / t / 1e12
        res["rows"].append({"kernel": name, "us": t * 1e6, "read_TBps": bw})
        print(f"{name:>40}: {t * 1e6:8.1f} us {bw:5.2f} TB/s", flush=True)

    for name in ("stream_h0_u4", "stream_h1_u4", "stream_h2_u4", "stream_h1_u8"):
        k = mod.get_function(name)
        for blocks_per_sm in (4, 8, 16):
            grid = sms * blocks_per_sm
            report(f"{name} grid {blocks_per_sm}/SM",
                   lambda k=k, g=grid: k((g,), (256,), (buf, cp.int64(n16), out)))
    for rb in [int(r) for r in args.row_bytes.split(",")]:
        row16 = rb // 16
        n_rows = n16 // row16
        for name in ("rows_h0_r1_u4", "rows_h1_r1_u4", "rows_h2_r1_u4", "rows_h1_r2_u4",
                     "rows_h1_r2_u2", "rows_h1_r4_u2", "rows_h1_r1_u8", "rows_h2_r2_u4"):
            r = int(name.split("_r")[1].split("_")[0])
            k = mod.get_function(name)
            for warps in (4, 8):
                grid = -(-n_rows // (warps * r))
                report(f"{name} row {rb}B {warps} warps",
                       lambda k=k, g=grid, w=warps: k((g,), (32 * w,),
                                                      (buf, cp.int32(n_rows), cp.int32(row16),
                                                       out)))
        for name in ("tiles_h1_u2", "tiles_h1_u4", "tiles_h2_u4", "tiles_h1_u8"):
            k = mod.get_function(name)
            for rows_per_block in (8, 32):
                span16 = rows_per_block * row16
                grid = -(-n16 // span16)
                report(f"{name} row {rb}B {rows_per_block} rows/block",
                       lambda k=k, g=grid, s=span16: k((g,), (256,),
                                                       (buf, cp.int64(n16), cp.int32(s), out)))
    # Arithmetic per byte, and the second (scale) stream: lm_head-like rows of 2560 bytes.
    row16 = 2560 // 16
    n_rows = n16 // row16
    for work in (0, 8, 16, 24, 32, 48):
        k = mod.get_function(f"rows_alu_w{work}")
        for warps in (4, 8):
            grid = -(-n_rows // (warps * 2))
            report(f"rows_alu {work:2d} FFMA/word {warps} warps",
                   lambda k=k, g=grid, w=warps: k((g,), (32 * w,),
                                                  (buf, cp.int32(n_rows), cp.int32(row16), out)))
    scales = cp.ones(n_rows * row16 // 2, cp.float32)  # 1/8 of the code bytes
    k = mod.get_function("rows_scales_k")
    for warps in (4, 8):
        grid = -(-n_rows // (warps * 2))
        t = timeit(lambda k=k, g=grid, w=warps: k((g,), (32 * w,), (buf, scales, cp.int32(n_rows),
                                                                     cp.int32(row16), out)))
        moved = n_bytes + scales.nbytes
        res["rows"].append({"kernel": f"rows_scales {warps} warps", "us": t * 1e6,
                            "read_TBps": moved / t / 1e12})
        print(f"{'rows + scale stream ' + str(warps) + ' warps':>40}: {t * 1e6:8.1f} us "
              f"{moved / t / 1e12:5.2f} TB/s (codes + scales)", flush=True)
    # The tensor-core kernels' pattern: 16-row tiles of 8 warps, 8 rows per warp instruction.
    for name in ("mma_w8_s0", "mma_w8_s1", "mma_w16_s0", "mma_w16_s1"):
        k = mod.get_function(name)
        grid = -(-n_rows // 16)
        t = timeit(lambda k=k, g=grid: k((g,), (256,), (buf, scales, cp.int32(n_rows),
                                                         cp.int32(2560), out)))
        moved = n_bytes + (scales.nbytes if name.endswith("s1") else 0)
        res["rows"].append({"kernel": name, "us": t * 1e6, "read_TBps": moved / t / 1e12})
        print(f"{name + ' 16-row tiles':>40}: {t * 1e6:8.1f} us {moved / t / 1e12:5.2f} TB/s",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
