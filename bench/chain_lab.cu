// The C1 decode step's 257 int4 GEMVs (the 27B's shapes, weights from the HBM), one kernel body
// run as 257 launches (a CUDA graph, the engine's form) and as ONE persistent kernel that walks
// the same chain with a grid barrier between GEMVs, with and without the next GEMV's first
// codes loaded (into registers, and into L2 by a bulk prefetch) before the barrier; 4 or 8
// steps of codes in flight a warp; the persistent kernel without its barriers (wrong sums,
// but the body's own stream: the bound of every form); and (v31) one CTA an SM whose
// warps each bulk-copy their first steps of the next GEMV (codes and scales, up to --slice-kb
// a warp) into shared memory before the barrier, so that those bytes are read while the grid
// waits, out of the x dependency (with its control: the same grid, no slices). The question
// it answers: how much of the step's GEMV time is the calls' boundaries (launch, ramp, tail),
// and so what a persistent layer kernel could give the engine, before anyone writes one.
// Standalone (no JAX, no engine code); built and run on the GPU machine
// (bench/h200_session.sh part `chain`):
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 bench/chain_lab.cu -o chain_lab
//   ./chain_lab [--reps 10] [--blocks 16] [--l2 8192] [--slice-kb 6,12,24] > chain_lab.jsonl
//
// The body (not the engine's kernel: its own, simpler, the same in every variant): the codes
// of a GEMV as [N, K/2] bytes (two 4-bit codes a byte, +8 offset; byte b of a 32-byte group
// holds k = 64g + b in its low nibble and 64g + 32 + b in its high one) and f32 scales
// [N, K/64]. The grid's warps split the GEMV's 512-byte steps (32 lanes x 16 bytes, half a
// 64-code group a lane) evenly, so every warp has the same work (+-1 step) at every shape; a
// warp keeps kD (4 or 8) steps of codes in flight in registers; codes become f16 pairs by a
// mask and an f16 magic number, multiply x (staged once a CTA in shared memory as f16, in the
// codes' order) in f16 pairs over one 16-byte load, and that sum, scaled, goes into an f32
// accumulator; a row's partial sums meet by atomicAdd in f32 (order not fixed: the check is a
// normwise error against a plain f32 reference, not bits). x of GEMV j is GEMV j - 1's output
// (at k mod its N, clamped to [-4, 4]): a real dependency chain, as in the step.
//
// Prints JSON lines: the chain's bytes, the read ceiling of the same bytes (one streaming
// kernel), each variant's step time, rate and fraction of the ceiling, and for the persistent
// variants the time between barriers by shape (block 0's globaltimer).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lab_common.cuh"

namespace chain {

constexpr int kWarps = 8;   // a CTA
constexpr int kMaxK = 17408;
constexpr int kShapes = 7;  // kinds, for the per-shape times
const char* const kShapeNames[kShapes] = {"in_proj 16480x5120", "out_proj 5120x6144",
                                          "gate|up 34816x5120", "down 5120x17408",
                                          "q|k|v 14336x5120",   "o_proj 5120x6144",
                                          "lm_head 248320x5120"};

struct Gemv {
  const uint8_t* w;  // [n, k/2]
  const float* s;    // [n, k/64]
  float* y;          // [n]: this GEMV's output, accumulated by atomicAdd
  const float* x;    // the previous GEMV's y, read at k mod xn
  float* ynext;      // the next GEMV's y, zeroed while this one runs
  int n, k, xn, nnext, shape;
};

__device__ unsigned g_count;
__device__ volatile unsigned g_gen;

__device__ __forceinline__ uint4 ld_codes(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float ld_scale(const float* p) {
  float v;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// HBM -> L2, no registers, no completion to wait on (sm_90's bulk prefetch).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// All CTAs of the (co-resident, cooperatively launched) grid.
__device__ __forceinline__ void grid_sync() {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = g_gen;
    __threadfence();
    if (atomicAdd(&g_count, 1u) == gridDim.x - 1) {
      g_count = 0;
      __threadfence();
      g_gen = gen + 1;
    } else {
      while (g_gen == gen) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ __half2 as_h2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }
__device__ __forceinline__ uint32_t as_u32(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }

// (c - 8) for the two codes of `v & 0x000F000F` (each 16-bit half's low nibble), as f16 pairs.
__device__ __forceinline__ __half2 codes2(uint32_t v) {
  uint32_t r;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(r) : "r"(v));  // (a & b) | c
  return __hsub2(as_h2(r), as_h2(0x64086408u));  // (1024 + c) - 1032
}

// One 16-byte load of codes (32 codes: 4 words) against its x from shared memory.
__device__ __forceinline__ float dot16(uint4 v, float scale, const uint4* xs, int pos, int npos) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  __half2 a = __float2half2_rn(0.0f);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 xq = xs[q * npos + pos];
    a = __hfma2(codes2(w[q]), as_h2(xq.x), a);
    a = __hfma2(codes2(w[q] >> 4), as_h2(xq.y), a);
    a = __hfma2(codes2(w[q] >> 8), as_h2(xq.z), a);
    a = __hfma2(codes2(w[q] >> 12), as_h2(xq.w), a);
  }
  const float2 f = __half22float2(a);
  return (f.x + f.y) * scale;
}

// x of GEMV g into shared memory in the codes' order: for 16-byte position p of a row (group
// p / 2, half p % 2) and word q, the four f16 pairs its nibbles meet (lo0, hi0, lo1, hi1).
__device__ __forceinline__ void stage_x(const Gemv& g, uint4* xs) {
  const int npos = g.k >> 5;
#pragma unroll 4  // several positions' x loads in flight: a staging is on every GEMV's path
  for (int i = threadIdx.x; i < 4 * npos; i += blockDim.x) {
    const int q = i / npos, p = i - q * npos;
    const int base = 64 * (p >> 1) + 16 * (p & 1) + 4 * q;
    auto xv = [&](int k) {
      const float v = __ldcg(g.x + (k % g.xn));
      return fminf(fmaxf(v, -4.0f), 4.0f);
    };
    uint4 o;
    o.x = as_u32(__floats2half2_rn(xv(base), xv(base + 2)));
    o.y = as_u32(__floats2half2_rn(xv(base + 32), xv(base + 34)));
    o.z = as_u32(__floats2half2_rn(xv(base + 1), xv(base + 3)));
    o.w = as_u32(__floats2half2_rn(xv(base + 33), xv(base + 35)));
    xs[q * npos + p] = o;
  }
  __syncthreads();
}

struct Range {
  int s0, s1, per_row;
};

__device__ __forceinline__ Range range_of(const Gemv& g) {
  const int warp = threadIdx.x >> 5;
  const long long wid = static_cast<long long>(blockIdx.x) * kWarps + warp;
  const long long wt = static_cast<long long>(gridDim.x) * kWarps;
  const long long steps = static_cast<long long>(g.n) * (g.k >> 10);
  return Range{static_cast<int>(steps * wid / wt), static_cast<int>(steps * (wid + 1) / wt),
               g.k >> 10};
}

template <int kD>  // steps (512 bytes of codes a warp) in flight a warp
struct Ring {
  uint4 c[kD];
  float s[kD];
};

// Step t's codes at w + t * 512 + lane * 16, its scale at s + t * 16 + lane / 2 (a warp's
// steps are contiguous bytes: rows follow each other).
template <int kD>
__device__ __forceinline__ void fill(const Gemv& g, const Range& r, Ring<kD>& ring, int lane) {
#pragma unroll
  for (int i = 0; i < kD; ++i)
    if (r.s0 + i < r.s1) {
      ring.c[i] = ld_codes(g.w + (static_cast<int64_t>(r.s0 + i) * 32 + lane) * 16);
      ring.s[i] = ld_scale(g.s + static_cast<int64_t>(r.s0 + i) * 16 + (lane >> 1));
    }
}

// Step t's codes and scale against x (its row's 16-byte position of this lane).
__device__ __forceinline__ float dot_step(const Range& r, int t, uint4 c, float scale,
                                          const uint4* xs, int npos, int lane) {
  const int row = t / r.per_row;
  return dot16(c, scale, xs, (t - row * r.per_row) * 32 + lane, npos);
}

// After step t: at its row's last step, or at r.s1, the warp's sum for the row goes out.
__device__ __forceinline__ void row_out(const Gemv& g, const Range& r, int t, int lane,
                                        float& acc) {
  if (t + 1 == r.s1 || (t + 1) % r.per_row == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) atomicAdd(g.y + t / r.per_row, acc);
    acc = 0.0f;
  }
}

// Steps [r.s0, r.s1) from the ring; `acc` carries a row's partial sum from steps before r.s0
// (the shared-memory slice's, mode 5).
template <int kD>
__device__ __forceinline__ void run(const Gemv& g, const Range& r, Ring<kD>& ring,
                                    const uint4* xs, int lane, float acc = 0.0f) {
  const int npos = g.k >> 5;
  for (int t0 = r.s0; t0 < r.s1; t0 += kD) {
#pragma unroll
    for (int i = 0; i < kD; ++i) {
      const int t = t0 + i;
      if (t < r.s1) {
        acc += dot_step(r, t, ring.c[i], ring.s[i], xs, npos, lane);
        if (t + kD < r.s1) {
          ring.c[i] = ld_codes(g.w + (static_cast<int64_t>(t + kD) * 32 + lane) * 16);
          ring.s[i] = ld_scale(g.s + static_cast<int64_t>(t + kD) * 16 + (lane >> 1));
        }
        row_out(g, r, t, lane, acc);
      }
    }
  }
}

__device__ __forceinline__ void zero_next(const Gemv& g) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < g.nnext; i += gridDim.x * blockDim.x)
    g.ynext[i] = 0.0f;
}

// Mode 5: a warp's first steps of a GEMV copied into its shared-memory slice by the bulk-copy
// engine (codes, then scales: a warp's steps are contiguous in both), completing on the warp's
// mbarrier. Issued when the warp is done with the GEMV before, so the copy runs while the grid
// waits at the barrier: the weights leave the x dependency.
constexpr int kStepBytes = 512 + 64;  // a step's codes and its 16 scales
constexpr int kXsBytes = 2 * kMaxK;   // x as f16 (the forms' shared memory before the slices)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void slice_issue(const Gemv& g, const Range& r, int steps,
                                            uint8_t* buf, uint64_t* bar) {
  if (steps <= 0) return;
  const uint32_t cb = 512u * steps, sb = 64u * steps;
  // the warp's reads of its slice (the GEMV before) come before the copy engine's writes
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_addr(bar)), "r"(cb + sb) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(buf)), "l"(g.w + static_cast<int64_t>(r.s0) * 512), "r"(cb),
      "r"(smem_addr(bar)) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(buf + cb)), "l"(g.s + static_cast<int64_t>(r.s0) * 16), "r"(sb),
      "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void slice_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
        " selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// Steps [r.s0, r.s0 + steps) from the slice; returns the open row's partial sum.
__device__ __forceinline__ float run_slice(const Gemv& g, const Range& r, int steps,
                                           const uint8_t* buf, const uint4* xs, int lane) {
  const int npos = g.k >> 5;
  const uint4* codes = reinterpret_cast<const uint4*>(buf);
  const float* scales = reinterpret_cast<const float*>(buf + 512 * steps);
  float acc = 0.0f;
  for (int i = 0; i < steps; ++i) {
    acc += dot_step(r, r.s0 + i, codes[i * 32 + lane], scales[i * 16 + (lane >> 1)], xs, npos,
                    lane);
    row_out(g, r, r.s0 + i, lane, acc);
  }
  return acc;
}

// kMode 0: GEMVs [first, first + count) as they come, no barrier (launched one a GEMV: the
// launch boundary is the barrier); 1: persistent, a grid barrier between GEMVs, each GEMV's
// ring filled after it; 2: the next GEMV's ring filled before the barrier; 3: as 2, and the
// next GEMV's codes past the ring (l2_bytes a warp) prefetched into L2 before the barrier;
// 4: as 2 without the barrier (wrong sums: the body's stream alone, a bound, not a form);
// 5: as 2, and each warp's first steps of the next GEMV (up to l2_bytes of codes and scales a
// warp) bulk-copied into its shared-memory slice before the barrier, the ring after them (one
// CTA an SM, all of its shared memory; l2_bytes 0: the same grid without slices).
template <int kMode, int kD>
__global__ void __launch_bounds__(kWarps * 32, kMode == 5 ? 1 : kD >= 8 ? 3 : 4)
    gemv_chain(const Gemv* __restrict__ chain, int first, int count, int total, int l2_bytes,
               unsigned long long* stamps) {
  extern __shared__ uint4 xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint8_t* const base = reinterpret_cast<uint8_t*>(xs);
  uint64_t* const bar = reinterpret_cast<uint64_t*>(base + kXsBytes) + warp;
  uint8_t* const buf = base + kXsBytes + 8 * kWarps + warp * l2_bytes;
  const int max_steps = kMode == 5 ? l2_bytes / kStepBytes : 0;
  uint32_t parity = 0;
  if (kMode == 5) {
    if (lane == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
    __syncthreads();
  }
  Ring<kD> ring;
  if (stamps && blockIdx.x == 0 && threadIdx.x == 0) stamps[0] = lab_now_ns();
  Gemv g = chain[first % total];
  Range r = range_of(g);
  int sl = min(max_steps, r.s1 - r.s0);  // the slice's steps of this GEMV
  if (kMode == 5 && lane == 0) slice_issue(g, r, sl, buf, bar);
  fill(g, Range{r.s0 + sl, r.s1, r.per_row}, ring, lane);
  for (int j = 0; j < count; ++j) {
    zero_next(g);
    stage_x(g, xs);
    if (kMode == 5) {
      float acc = 0.0f;
      if (sl > 0) {
        slice_wait(bar, parity);
        parity ^= 1;
        acc = run_slice(g, r, sl, buf, xs, lane);
      }
      run(g, Range{r.s0 + sl, r.s1, r.per_row}, ring, xs, lane, acc);
    } else {
      run(g, r, ring, xs, lane);
    }
    if (j + 1 == count) break;
    const Gemv gn = chain[(first + j + 1) % total];
    const Range rn = range_of(gn);
    if (kMode == 5) {
      sl = min(max_steps, rn.s1 - rn.s0);
      __syncwarp();  // every lane is done reading the slice
      if (lane == 0) slice_issue(gn, rn, sl, buf, bar);
      fill(gn, Range{rn.s0 + sl, rn.s1, rn.per_row}, ring, lane);
    } else if (kMode >= 2) {
      fill(gn, rn, ring, lane);
    }
    if (kMode == 3 && lane == 0) {
      const int64_t from = static_cast<int64_t>(rn.s0 + kD) * 512;
      const int64_t to = static_cast<int64_t>(rn.s1) * 512;
      const int64_t bytes = to - from < l2_bytes ? to - from : l2_bytes;
      if (bytes >= 16) prefetch_l2(gn.w + from, static_cast<unsigned>(bytes & ~15ll));
    }
    if ((kMode >= 1 && kMode <= 3) || kMode == 5) grid_sync();
    __syncthreads();  // xs is restaged
    if (stamps && blockIdx.x == 0 && threadIdx.x == 0) stamps[j + 1] = lab_now_ns();
    if (kMode < 2) fill(gn, rn, ring, lane);
    g = gn;
    r = rn;
  }
  if (stamps) {
    if ((kMode >= 1 && kMode <= 3) || kMode == 5) grid_sync();
    if (blockIdx.x == 0 && threadIdx.x == 0) stamps[count] = lab_now_ns();
  }
}

// f32 reference of GEMV g from the same x as the kernel staged (f16-rounded, clamped).
__global__ void reference(Gemv g, float* out) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= g.n) return;
  double acc = 0.0;
  for (int gi = 0; gi < g.k / 64; ++gi) {
    const float sc = g.s[static_cast<int64_t>(row) * (g.k / 64) + gi];
    double part = 0.0;
    for (int b = 0; b < 32; ++b) {
      const uint8_t byte = g.w[static_cast<int64_t>(row) * (g.k / 2) + gi * 32 + b];
      for (int hi = 0; hi < 2; ++hi) {
        const int k = 64 * gi + 32 * hi + b;
        const float xv = __half2float(__float2half_rn(
            fminf(fmaxf(g.x[k % g.xn], -4.0f), 4.0f)));
        part += static_cast<double>(((byte >> (4 * hi)) & 15) - 8) * xv;
      }
    }
    acc += part * sc;
  }
  out[row] = static_cast<float>(acc);
}

__device__ __forceinline__ uint32_t mix(uint64_t v) {
  v ^= v >> 33;
  v *= 0xff51afd7ed558ccdull;
  v ^= v >> 33;
  v *= 0xc4ceb9fe1a85ec53ull;
  v ^= v >> 33;
  return static_cast<uint32_t>(v);
}

__global__ void fill_codes(uint4* p, int64_t n16, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t b = seed * 0x9E3779B97F4A7C15ull + 4 * i;
    p[i] = make_uint4(mix(b), mix(b + 1), mix(b + 2), mix(b + 3));
  }
}

// Scales near 1 / (sd(code) sqrt(K)), so that x keeps its size along the chain.
__global__ void fill_scales(float* p, int64_t n, int k, uint64_t seed) {
  const float base = 1.0f / (4.61f * sqrtf(static_cast<float>(k)));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = base * (0.5f + (mix(seed * 0x2545F4914F6CDD1Dull + i) >> 8) * (1.0f / 16777216.0f));
}

__global__ void fill_x(float* p, int n, uint64_t seed) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = ((mix(seed + i) >> 8) * (1.0f / 16777216.0f) - 0.5f) * 3.0f;
}

__global__ void read_all(const uint4* __restrict__ p, int64_t n16, uint4* sink) {
  uint32_t a = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = ld_codes(reinterpret_cast<const uint8_t*>(p + i));
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (a == 0x12345678u) sink->x = a;  // never, but the loads stay
}

struct Layer {
  int n, k, shape;
};

}  // namespace chain

int main(int argc, char** argv) {
  using namespace chain;
  int reps = 10, blocks = 16, l2_bytes = 8192;
  std::vector<int> slice_kbs;  // mode 5's slices to run, KB a warp (none given: the largest)
  bool bad = false;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 == argc) bad = true;  // a flag without its value
    else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--blocks")) blocks = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--l2")) l2_bytes = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--slice-kb")) {
      for (const char* p = argv[i + 1]; *p && !bad;) {
        char* end;
        const long v = strtol(p, &end, 10);
        bad = end == p || v < 0 || v > 1024 || (*end && *end != ',');
        slice_kbs.push_back(static_cast<int>(v));
        p = *end ? end + 1 : end;
      }
    } else {
      bad = true;
    }
    if (bad) {
      fprintf(stderr,
              "usage: %s [--reps N] [--blocks B (of 4 layers)] [--l2 BYTES] "
              "[--slice-kb KB[,KB...] (a warp's shared-memory slices to run, mode 5; default "
              "the largest)]\n",
              argv[0]);
      return 2;
    }
  }
  // The 27B's C1 step: 16 blocks of 3 GDN layers and one attention layer, then lm_head.
  std::vector<Layer> layers;
  for (int b = 0; b < blocks; ++b) {
    for (int l = 0; l < 3; ++l) {
      layers.push_back({16480, 5120, 0});
      layers.push_back({5120, 6144, 1});
      layers.push_back({34816, 5120, 2});
      layers.push_back({5120, 17408, 3});
    }
    layers.push_back({14336, 5120, 4});
    layers.push_back({5120, 6144, 5});
    layers.push_back({34816, 5120, 2});
    layers.push_back({5120, 17408, 3});
  }
  layers.push_back({248320, 5120, 6});
  const int total = static_cast<int>(layers.size());

  // One allocation for every GEMV's codes and scales (so one kernel can read them all).
  std::vector<int64_t> woff(total), soff(total), yoff(total);
  int64_t bytes = 0, ys = 0;
  for (int j = 0; j < total; ++j) {
    woff[j] = bytes;
    bytes += static_cast<int64_t>(layers[j].n) * layers[j].k / 2;
    soff[j] = bytes;
    bytes += static_cast<int64_t>(layers[j].n) * (layers[j].k / 64) * 4;
    bytes = (bytes + 255) / 256 * 256;
    yoff[j] = ys;
    ys += (layers[j].n + 63) / 64 * 64;
  }
  uint8_t* wbuf;
  float* ybuf;
  uint4* sink;
  CK(cudaMalloc(&wbuf, bytes));
  CK(cudaMalloc(&ybuf, ys * 4));
  CK(cudaMalloc(&sink, 16));
  for (int j = 0; j < total; ++j) {
    const Layer& L = layers[j];
    fill_codes<<<1024, 256>>>(reinterpret_cast<uint4*>(wbuf + woff[j]),
                              static_cast<int64_t>(L.n) * L.k / 32, 1000 + j);
    fill_scales<<<1024, 256>>>(reinterpret_cast<float*>(wbuf + soff[j]),
                               static_cast<int64_t>(L.n) * (L.k / 64), L.k, 7000 + j);
  }
  fill_x<<<1024, 256>>>(ybuf, static_cast<int>(ys), 99);
  CK(cudaDeviceSynchronize());

  std::vector<Gemv> hchain(total);
  for (int j = 0; j < total; ++j) {
    const int p = (j + total - 1) % total, nx = (j + 1) % total;
    hchain[j] = Gemv{wbuf + woff[j], reinterpret_cast<const float*>(wbuf + soff[j]),
                     ybuf + yoff[j], ybuf + yoff[p], ybuf + yoff[nx], layers[j].n,
                     layers[j].k, layers[p].n, layers[nx].n, layers[j].shape};
  }
  Gemv* dchain;
  CK(cudaMalloc(&dchain, total * sizeof(Gemv)));
  CK(cudaMemcpy(dchain, hchain.data(), total * sizeof(Gemv), cudaMemcpyHostToDevice));
  unsigned long long* stamps;
  CK(cudaMalloc(&stamps, (total + 1) * 8));

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int smem = kXsBytes;  // x as f16, 4 words x K/32 positions x 16 bytes
  // mode 5: x, a mbarrier a warp, and each warp's slice, whole steps, in an SM's shared memory
  const int slice_max =
      (static_cast<int>(prop.sharedMemPerBlockOptin) - kXsBytes - 8 * kWarps) / kWarps /
      kStepBytes * kStepBytes;
  const int slice_smem = kXsBytes + 8 * kWarps + kWarps * slice_max;  // every slice's grid
  printf("{\"kind\": \"setup\", \"device\": \"%s\", \"sms\": %d, \"warps_a_cta\": %d, "
         "\"gemvs\": %d, \"bytes\": %lld, \"l2_bytes_a_warp\": %d}\n",
         prop.name, prop.multiProcessorCount, kWarps, total, static_cast<long long>(bytes),
         l2_bytes);
  fflush(stdout);

  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timed = [&](auto&& launch) {
    for (int w = 0; w < 2; ++w) launch();
    CK(cudaStreamSynchronize(s));
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms) * 1e3 / reps;  // us a step
  };

  const double ceil_us = timed([&] {
    read_all<<<prop.multiProcessorCount * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(wbuf),
                                                           bytes / 16, sink);
  });
  printf("{\"kind\": \"time\", \"variant\": \"read ceiling\", \"us\": %.1f, \"tbps\": %.3f}\n",
         ceil_us, bytes / ceil_us / 1e6);
  fflush(stdout);

  // The check: after a variant's runs, GEMVs 2.. against the f32 reference of their x.
  float* ref;
  CK(cudaMalloc(&ref, 248320 * 4));
  auto check = [&](const char* name) {
    double worst = 0;
    for (int j : {2, 3, 4, 5, 6, 7, 8, 9, total - 1}) {
      const Gemv& g = hchain[j];
      reference<<<(g.n + 127) / 128, 128, 0, s>>>(g, ref);
      std::vector<float> a(g.n), b(g.n);
      CK(cudaMemcpyAsync(a.data(), g.y, g.n * 4, cudaMemcpyDeviceToHost, s));
      CK(cudaMemcpyAsync(b.data(), ref, g.n * 4, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      double num = 0, den = 0;
      for (int i = 0; i < g.n; ++i) {
        num += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
        den += static_cast<double>(b[i]) * b[i];
      }
      worst = std::max(worst, den > 0 ? std::sqrt(num / den) : 1.0);
    }
    printf("{\"kind\": \"check\", \"variant\": \"%s\", \"worst_rel_err\": %.3g, \"ok\": %s}\n",
           name, worst, worst < 2e-2 ? "true" : "false");
    fflush(stdout);
  };

  // One form: its kernel, its grid (every CTA resident: as many as its registers and shared
  // memory let an SM hold), its step time, the check, and for the persistent forms one
  // stamped run (the time between barriers, by shape).
  // slice_bytes >= 0: mode 5's shared-memory slice a warp (the kernel's l2_bytes argument), its
  // CTA given all of an SM's shared memory.
  auto form = [&](const void* kernel, const char* name, bool separate, int ring, bool checked,
                  int slice_bytes = -1) {
    const int fsmem = slice_bytes < 0 ? smem : slice_smem;
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, fsmem));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kWarps * 32, fsmem));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, kernel));
    const int grid = occ * prop.multiProcessorCount;
    unsigned long long* st = nullptr;
    int first = 0, count = total, tot = total, l2 = slice_bytes < 0 ? l2_bytes : slice_bytes;
    void* args[] = {&dchain, &first, &count, &tot, &l2, &st};
    double us = 0;
    if (separate) {  // the chain as a CUDA graph of `total` launches
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      count = 1;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int j = 0; j < total; ++j) {
        first = j;  // the launch copies its arguments
        CK(cudaLaunchKernel(kernel, grid, kWarps * 32, args, fsmem, s));
      }
      CK(cudaStreamEndCapture(s, &graph));
      CK(cudaGraphInstantiate(&exec, graph, 0));
      us = timed([&] { CK(cudaGraphLaunch(exec, s)); });
      CK(cudaGraphExecDestroy(exec));
      CK(cudaGraphDestroy(graph));
      first = 0;
      count = total;
    } else {
      us = timed([&] {
        CK(cudaLaunchCooperativeKernel(kernel, grid, kWarps * 32, args, fsmem, s));
      });
    }
    printf("{\"kind\": \"time\", \"variant\": \"%s\", \"ring_steps\": %d, \"grid\": %d, "
           "\"regs\": %d, \"slice_bytes_a_warp\": %d, \"us\": %.1f, \"tbps\": %.3f, "
           "\"of_ceiling\": %.3f}\n",
           name, ring, grid, fa.numRegs, slice_bytes < 0 ? 0 : slice_bytes, us,
           bytes / us / 1e6, ceil_us / us);
    fflush(stdout);
    if (checked) check(name);
    if (separate) return;
    st = stamps;
    CK(cudaLaunchCooperativeKernel(kernel, grid, kWarps * 32, args, fsmem, s));
    std::vector<unsigned long long> h(total + 1);
    CK(cudaMemcpyAsync(h.data(), stamps, (total + 1) * 8, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    double sum[kShapes] = {}, mb[kShapes] = {};
    int cnt[kShapes] = {};
    for (int j = 0; j < total; ++j) {
      const int sh = layers[j].shape;
      sum[sh] += (h[j + 1] - h[j]) / 1e3;
      mb[sh] = layers[j].n * (layers[j].k / 2.0 + layers[j].k / 16.0) / 1e6;
      ++cnt[sh];
    }
    for (int sh = 0; sh < kShapes; ++sh)
      if (cnt[sh])
        printf("{\"kind\": \"shape\", \"variant\": \"%s\", \"ring_steps\": %d, "
               "\"shape\": \"%s\", \"calls\": %d, \"us_a_call\": %.2f, \"tbps\": %.3f}\n",
               name, ring, kShapeNames[sh], cnt[sh], sum[sh] / cnt[sh],
               mb[sh] / (sum[sh] / cnt[sh]));
    printf("{\"kind\": \"stamped\", \"variant\": \"%s\", \"ring_steps\": %d, \"us\": %.1f}\n",
           name, ring, (h[total] - h[0]) / 1e3);
    fflush(stdout);
  };
  const char* sep = "separate launches";
  const char* per = "persistent";
  const char* ring = "persistent, ring filled before the barrier";
  const char* l2 = "persistent, ring and L2 prefetch before the barrier";
  const char* bound = "persistent, no barrier (the body's stream alone)";
  form(reinterpret_cast<const void*>(gemv_chain<0, 4>), sep, true, 4, true);
  form(reinterpret_cast<const void*>(gemv_chain<0, 8>), sep, true, 8, true);
  form(reinterpret_cast<const void*>(gemv_chain<1, 4>), per, false, 4, true);
  form(reinterpret_cast<const void*>(gemv_chain<2, 4>), ring, false, 4, true);
  form(reinterpret_cast<const void*>(gemv_chain<2, 8>), ring, false, 8, true);
  form(reinterpret_cast<const void*>(gemv_chain<3, 4>), l2, false, 4, true);
  form(reinterpret_cast<const void*>(gemv_chain<3, 8>), l2, false, 8, true);
  form(reinterpret_cast<const void*>(gemv_chain<4, 4>), bound, false, 4, false);
  // one CTA an SM: without slices (the grid's own effect), then with them
  const char* grid1 = "persistent, one CTA an SM, ring filled before the barrier";
  form(reinterpret_cast<const void*>(gemv_chain<5, 8>), grid1, false, 8, true, 0);
  if (slice_kbs.empty()) slice_kbs.push_back(slice_max / 1024);
  for (const int kb : slice_kbs) {
    const int sb = std::min(slice_max, kb * 1024 / kStepBytes * kStepBytes);
    char slices[128];
    snprintf(slices, sizeof slices,
             "persistent, one CTA an SM, the next GEMV's first steps in shared memory "
             "(%d B a warp)", sb);
    form(reinterpret_cast<const void*>(gemv_chain<5, 8>), slices, false, 8, true, sb);
  }
  return 0;
}
