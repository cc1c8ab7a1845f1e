// Weight-only int4 (group 64) GEMV for decode, as an XLA FFI custom call on CUDA.
//
// y[m, n] = sum_k x[m, k] * (code[n, k] - 8) * scale[n, k / 64]      (fp32 accumulation)
//
// The weight is the converter's int4_g64 layout: uint8 [*lead, N, K/2], byte j of a row holding
// the codes of inputs 2j (low nibble) and 2j+1 (high nibble), +8 offset; scales fp32
// [*lead, N, K/64]. `lead` stack dims (a scanned model's layers) are indexed by the int32
// operand `index`, read on the device, so the kernel reads one layer of the stack in place.
//
// Two kernels: `int4_gemv` (fp32 FMAs, any M, the faster one for M <= 2) and `int4_gemv_mma`
// (bf16 tensor cores, cost flat in M; below). Measured on the H200: both stop near 2.1 TB/s on
// the large matrices, against 4.2 TB/s for a copy.
//
// Why a CUDA kernel: the Pallas/Triton version tops out near 1.1 TB/s of int4 bytes because its
// unpack-and-FMA loop is instruction-bound. Here every 32-bit word of codes is 8 consecutive
// inputs (nibble i = input +i), and a nibble becomes an exact float without an int->float
// conversion and without a shift for five of the eight positions: OR-ing the masked word into
// the mantissa of 2^23 gives 2^23 + q * 16^p for the nibble at position p <= 4, and subtracting
// 2^23 + 8 * 16^p gives (q - 8) * 16^p exactly. The 16^p factor is taken out once per chunk by
// keeping one accumulator per position. Nibbles 5..7 reuse positions 2..4 after one shift.
// Cost per code: one LOP3, one FADD, one FFMA per row of x (+ a shift per 8 codes).
//
// Work split: one warp owns R output rows; each lane reads 16-byte chunks (32 codes, half a
// group) c = lane, lane + 32, ... of all R rows, U chunks per row ahead, so R * U 16-byte loads
// are in flight per lane before any arithmetic. The R rows share each x load.
//
// x comes permuted (by the caller, a tiny XLA transpose): [M, K/1024, 4 words, 2 halves, 32
// lanes, 4], i.e. the 4 inputs that lane l needs for half h of word w of its chunk in iteration
// i are contiguous with those of lanes l +- 1. Read in the plain [M, K] layout, a warp's float4
// load touches 32 cache lines (lanes 128 bytes apart) and the L1 wavefronts, not the HBM,
// bound the kernel; permuted, each warp-wide load is 512 contiguous bytes. The lanes' sums
// are reduced with shuffles in a fixed order: the result of a row does not depend on M, on the
// other rows or on the launch (batch-invariant, deterministic).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ring_run's branch-free full rounds (see ring_run) in the few-tile calls only (the wide kernel
// at 8 or more warps a tile: out_proj, o_proj; the MLP op's down). H200 kernel times: faster
// where a warp's chain of pairs holds the call (down-like 5120 x 17408: 19.25 against 20.81 us;
// out_proj 9.05 against 9.68), slower at the full-wave calls (gate|up 34816 x 5120: 38.3-38.8
// against 35.8-36.6; in_proj 16.95 against 16.54), where the later refills cost more than the
// overlap gains.
__host__ __device__ constexpr bool full_rounds(bool few) { return few; }

constexpr int kWarps = 4;  // warps per block
constexpr uint32_t kMagic = 0x4B000000u;  // the bits of 2^23 in fp32

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  // Weights are read once per step and never fit in L2: keep them out of L1 so x stays there.
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// load_stream through the coherent path (LDG.E.NA, not .CONSTANT): ptxas keeps these ahead of
// a `griddepcontrol.wait` that follows them, where it moves the wait above read-only loads.
__device__ __forceinline__ uint4 load_stream_coherent(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float2 load_coherent(const float2* p) {
  float2 v;
  asm volatile("ld.global.L1::no_allocate.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

// The sum over a warp's 32 lanes, every lane the same (a fixed xor tree).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// (a & MASK) | MAGIC in one LOP3. Written as C, the compiler emits an AND and an OR: a SASS
// LOP3 takes one immediate, so both constants cannot ride in one instruction unless one of
// them sits in a register, which it then hoists out of the loop. One logic op a code instead
// of two: the kernels below are issue-bound (ncu).
template <uint32_t MASK, uint32_t MAGIC>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(MAGIC));
  return d;
}

template <uint32_t MASK>
__device__ __forceinline__ float code(uint32_t v, float off) {
  return __uint_as_float(and_or<MASK, kMagic>(v)) - off;
}

template <typename OT>
__device__ __forceinline__ OT to_out(float v);
template <>
__device__ __forceinline__ float to_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// One 32-bit word of codes (inputs k .. k+7) of one row, against M rows of x.
template <int M>
__device__ __forceinline__ void word(uint32_t v, const float4 (&xa)[M], const float4 (&xb)[M],
                                     float (&acc)[M][5]) {
  constexpr float o0 = 8388608.0f + 8.0f, o1 = 8388608.0f + 128.0f,
                  o2 = 8388608.0f + 2048.0f, o3 = 8388608.0f + 32768.0f,
                  o4 = 8388608.0f + 524288.0f;
  const uint32_t s = v >> 12;  // nibbles 5, 6, 7 at positions 2, 3, 4
  const float c0 = code<0xFu>(v, o0), c1 = code<0xF0u>(v, o1), c2 = code<0xF00u>(v, o2),
              c3 = code<0xF000u>(v, o3), c4 = code<0xF0000u>(v, o4),
              c5 = code<0xF00u>(s, o2), c6 = code<0xF000u>(s, o3), c7 = code<0xF0000u>(s, o4);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[m][0] = fmaf(c0, xa[m].x, acc[m][0]);
    acc[m][1] = fmaf(c1, xa[m].y, acc[m][1]);
    acc[m][2] = fmaf(c2, xa[m].z, acc[m][2]);
    acc[m][3] = fmaf(c3, xa[m].w, acc[m][3]);
    acc[m][4] = fmaf(c4, xb[m].x, acc[m][4]);
    acc[m][2] = fmaf(c5, xb[m].y, acc[m][2]);
    acc[m][3] = fmaf(c6, xb[m].z, acc[m][3]);
    acc[m][4] = fmaf(c7, xb[m].w, acc[m][4]);
  }
}

// The weights one call multiplies x by: one matrix, or several sharing x and K (a layer's
// projections of the same input: q/k/v, qkv/z/b/a, gate/up) whose outputs are concatenated
// along N, so one launch (and one preparation of x) serves them all. Each has the same stack
// dims, read at the same layer index.
constexpr int kMaxMats = 4;

struct Mats {
  const uint8_t* w[kMaxMats];  // [*lead, n_j, K/2] codes
  const float* s[kMaxMats];    // [*lead, n_j, K/64] scales
  int start[kMaxMats + 1];     // first output row of each; start[count] = N in all
  int count;
  int nlead;
  int64_t l[3];                // layer = sum index[d] * l[d]
};

// kCoherent: index read through L2 (`__ldcg`), as a load ahead of `griddepcontrol.wait` must
// be (see load_stream_coherent).
template <bool kCoherent = false>
__device__ __forceinline__ int64_t layer_of(const Mats& mt, const int32_t* index) {
  auto at = [index](int i) { return static_cast<int64_t>(kCoherent ? __ldcg(index + i)
                                                                    : index[i]); };
  int64_t layer = 0;
  if (mt.nlead > 0) layer += at(0) * mt.l[0];
  if (mt.nlead > 1) layer += at(1) * mt.l[1];
  if (mt.nlead > 2) layer += at(2) * mt.l[2];
  return layer;
}

// Output row `row` (< N) -> the start of its codes and of its scales.
__device__ __forceinline__ void row_ptrs(const Mats& mt, int row, int64_t layer, int k,
                                         const uint8_t*& wrow, const float*& srow) {
  // Selects with constant indices only: indexing the (parameter-space) struct with a runtime
  // index would copy it to local memory.
  const uint8_t* w = mt.w[0];
  const float* sc = mt.s[0];
  int lo = mt.start[0], hi = mt.start[1];
#pragma unroll
  for (int i = 1; i < kMaxMats; ++i) {
    if (i < mt.count && row >= mt.start[i]) {
      w = mt.w[i];
      sc = mt.s[i];
      lo = mt.start[i];
      hi = mt.start[i + 1];
    }
  }
  const int64_t r = layer * (hi - lo) + (row - lo);
  wrow = w + r * (k >> 1);
  srow = sc + r * (k >> 6);
}

template <int M, int R, int U, typename OT>
__global__ void __launch_bounds__(kWarps * 32)
    int4_gemv(const float4* __restrict__ x, const __grid_constant__ Mats mt,
              const int32_t* __restrict__ index,
              OT* __restrict__ y, int k) {
  const int n = mt.start[mt.count];
  const int64_t layer = layer_of(mt, index);
  const int chunks = k >> 5;  // 16-byte chunks (32 codes) per row
  const int64_t x_row = static_cast<int64_t>((k + 1023) >> 10) * 256;  // float4s per x row
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;
  if (row0 >= n) return;
  const uint4* wr[R];
  const float* sr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {  // rows past n compute a copy of the last row, never stored
    const uint8_t* wrow;
    row_ptrs(mt, min(row0 + r, n - 1), layer, k, wrow, sr[r]);
    wr[r] = reinterpret_cast<const uint4*>(wrow);
  }

  float tot[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) tot[m][r] = 0.0f;

  for (int c0 = 0; c0 < chunks; c0 += 32 * U) {
    uint4 q[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < R; ++r)
        q[r][u] = c < chunks ? load_stream(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c >= chunks) break;
      float acc[R][M][5];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int p = 0; p < 5; ++p) acc[r][m][p] = 0.0f;
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        float4 xa[M], xb[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4* xp = x + m * x_row + ((c >> 5) * 8 + wi * 2) * 32 + lane;
          xa[m] = __ldg(xp);
          xb[m] = __ldg(xp + 32);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t v = wi == 0 ? q[r][u].x : wi == 1 ? q[r][u].y : wi == 2 ? q[r][u].z
                                                                               : q[r][u].w;
          word<M>(v, xa, xb, acc[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float s = __ldg(sr[r] + (c >> 1));
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float part = acc[r][m][0] + acc[r][m][1] * (1.0f / 16.0f) +
                             acc[r][m][2] * (1.0f / 256.0f) + acc[r][m][3] * (1.0f / 4096.0f) +
                             acc[r][m][4] * (1.0f / 65536.0f);
          tot[m][r] = fmaf(part, s, tot[m][r]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      tot[m][r] = warp_sum(tot[m][r]);
    }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < n) {
#pragma unroll
        for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * n + row0 + r] = to_out<OT>(tot[m][r]);
      }
    }
  }
}


// ---- Tensor-core variant (bf16 x) -------------------------------------------------------
//
// For bf16 activations the FMA kernel above is instruction-bound: three instructions per code
// and one more per extra row of x. Here the dot products run on the tensor cores: per group of
// 64 inputs, a warp multiplies a [16 rows x 64] tile of weights by x [64 x 8 columns] (the
// M <= 8 rows of x, zero-padded) with four m16n8k16 bf16 MMAs accumulating in fp32. The A
// operand is made from the codes with one shift and one logic op per two codes: the mask
// 0x000F000F picks nibbles e and e + 4 of a 32-bit word into the two halves of a register and
// OR-ing 0x43004300 turns each into the bf16 128 + q, exact. The MMA sums x * (128 + q); the
// caller supplies corr = 136 * sum(x) per (group, column), so that per group
//   sum x * (q - 8) = mma - corr        (exact products, fp32 sums; the cancellation costs a
// few of fp32's 24 bits), which is then scaled by the row's group scale in fp32.
//
// Any permutation of the 64 inputs of a group gives the same sum as long as A and B agree, so
// each lane keeps its own contiguous 16 codes (an 8-byte load) and the caller permutes x
// instead: lane (g, t) holds, for MMA j of a group, x[g][16 t + o] for o in
// (8 (j / 2) + 2 (j % 2)) + {0, 4, 1, 5}: xp is [G, 8 columns, 4 t, 16] bf16, 32 contiguous
// bytes per lane, so a warp's x load is 1 KB contiguous.
//
// A block of 8 warps owns 16 output rows; warp w takes groups w, w + 8, ... (the 8 warps read
// adjacent 32-byte pieces of the same rows). Each warp streams its groups' codes and scales into
// its own shared-memory ring with cp.async, S = kMmaStages stages of kMmaU groups (S - 1 stages
// in flight while it computes one; the `stages` attribute, which must be 4: deeper rings of 6,
// 8 and 12 stages measured no faster on the H200, 12 slower than 4, and a register ring
// loading codes and scales 2, 4 or 8 groups ahead, with 3.6 instructions a byte against the
// copy ring's ~6, no faster either: lm_head at M = 1 334 us at 4 groups against 330 us).
// The warps' partial sums are added in shared memory in warp order: no atomics, the same order
// whatever M is (batch-invariant, deterministic).
//
// Several weights sharing x (a layer's projections of one input) are one call: `Mats` lists
// them, their outputs concatenated along N; each row finds its weight, so a 16-row tile may
// straddle two of them.
constexpr int kMmaWarps = 8;

__device__ __forceinline__ uint32_t pair(uint32_t w, int e) {
  return and_or<0x000F000Fu, 0x43004300u>(w >> (4 * e));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// dst: a shared-memory address (__cvta_generic_to_shared), computed once by the caller.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// What a warp of the tensor-core kernels reads besides the weights: x fragments and column
// corrections. Its i-th group is group warp + 8 i: x at + 512 i (uint4), corr at + 32 i (float2).
// A lane whose column g is past M reads no x (zeros).
struct MmaInputs {
  const uint4* x;
  const float2* c;
  bool has_x;
  int count;  // the warp's groups

  __device__ __forceinline__ MmaInputs(const uint4* xp, const float2* corr, int groups,
                                       int warp, int g, int t, int m)
      : x(xp + ((static_cast<int64_t>(warp) * 8 + g) * 4 + t) * 2),
        c(corr + warp * 4 + t),
        has_x(g < m),
        count(warp < groups ? (groups - warp + kMmaWarps - 1) / kMmaWarps : 0) {}

  __device__ __forceinline__ void advance(int i) {  // by i groups of the warp
    x += 512 * i;
    c += 32 * i;
  }
};

// The warp's group `u` (counted from `in`'s position) of a 16-row tile: lane (g, t) holds 16
// codes of row g (qa) and of row g + 8 (qb) and the two rows' scales.
__device__ __forceinline__ void mma_group(uint2 qa, uint2 qb, float sa, float sb,
                                          const MmaInputs& in, int u, float (&tot)[4]) {
  uint4 x0 = make_uint4(0, 0, 0, 0), x1 = make_uint4(0, 0, 0, 0);
  if (in.has_x) {
    x0 = __ldg(in.x + 512 * u);
    x1 = __ldg(in.x + 512 * u + 1);
  }
  const float2 c = __ldg(in.c + 32 * u);  // columns 2t, 2t + 1
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_bf16(d, pair(qa.x, 0), pair(qb.x, 0), pair(qa.x, 1), pair(qb.x, 1), x0.x, x0.y);
  mma_bf16(d, pair(qa.x, 2), pair(qb.x, 2), pair(qa.x, 3), pair(qb.x, 3), x0.z, x0.w);
  mma_bf16(d, pair(qa.y, 0), pair(qb.y, 0), pair(qa.y, 1), pair(qb.y, 1), x1.x, x1.y);
  mma_bf16(d, pair(qa.y, 2), pair(qb.y, 2), pair(qa.y, 3), pair(qb.y, 3), x1.z, x1.w);
  tot[0] = fmaf(sa, d[0] - c.x, tot[0]);
  tot[1] = fmaf(sa, d[1] - c.y, tot[1]);
  tot[2] = fmaf(sb, d[2] - c.x, tot[2]);
  tot[3] = fmaf(sb, d[3] - c.y, tot[3]);
}

// The warps' partial sums of a 16-row tile, added in shared memory in warp order (no atomics:
// the same order whatever M is), and stored by warp 0. Ends with a block-wide barrier.
template <typename OT>
__device__ __forceinline__ void mma_reduce_store(float4 (&red)[kMmaWarps][32],
                                                 const float (&tot)[4], int warp, int lane,
                                                 int row0, int n, int m, OT* __restrict__ y) {
  red[warp][lane] = make_float4(tot[0], tot[1], tot[2], tot[3]);
  __syncthreads();
  if (warp == 0) {
    float4 s = red[0][lane];
#pragma unroll
    for (int v = 1; v < kMmaWarps; ++v) {
      const float4 o = red[v][lane];
      s.x += o.x;
      s.y += o.y;
      s.z += o.z;
      s.w += o.w;
    }
    const int g = lane >> 2, t = lane & 3;
    const int ra = row0 + g, rb = ra + 8, c0 = 2 * t, c1 = 2 * t + 1;
    if (ra < n) {
      if (c0 < m) y[static_cast<int64_t>(c0) * n + ra] = to_out<OT>(s.x);
      if (c1 < m) y[static_cast<int64_t>(c1) * n + ra] = to_out<OT>(s.y);
    }
    if (rb < n) {
      if (c0 < m) y[static_cast<int64_t>(c0) * n + rb] = to_out<OT>(s.z);
      if (c1 < m) y[static_cast<int64_t>(c1) * n + rb] = to_out<OT>(s.w);
    }
  }
}

// Shared memory of one warp's stage: U groups, each 16 rows x 32 bytes of codes (32 uint4,
// row-major) followed by the 16 rows' scales (4 uint4).
constexpr int kMmaU = 2;
constexpr int kGroupVec = 36;
constexpr int kMmaStages = 4;
constexpr int kMmaSmemBytes = kMmaWarps * kMmaStages * kMmaU * kGroupVec * 16;

template <typename OT>
__global__ void __launch_bounds__(kMmaWarps * 32)
    int4_gemv_mma(const uint4* __restrict__ xp, const float2* __restrict__ corr,
                  const __grid_constant__ Mats mt,
                  const int32_t* __restrict__ index, OT* __restrict__ y, int k, int m) {
  constexpr int S = kMmaStages;
  extern __shared__ uint4 smem[];
  __shared__ float4 red[kMmaWarps][32];
  const int n = mt.start[mt.count];
  const int64_t layer = layer_of(mt, index);
  const int groups = k >> 6;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  // Everything a stage needs is an offset from a base fixed here: the loop below spends its
  // instructions on codes, not on addresses (the kernel is issue-bound).
  // Copy roles: lane l copies half (l & 1) of row (l >> 1)'s 32 bytes of a group; lanes 0..15
  // copy the scale of row l. The warp's i-th group is group warp + 8 i.
  const uint8_t* wrow;
  const float* ssrc;
  const float* unused;
  row_ptrs(mt, min(row0 + (lane >> 1), n - 1), layer, k, wrow, unused);
  const uint4* wsrc = reinterpret_cast<const uint4*>(wrow) + (lane & 1) + 2 * warp;
  row_ptrs(mt, min(row0 + (lane & 15), n - 1), layer, k, wrow, ssrc);
  ssrc += warp;
  const bool scale_lane = lane < 16;
  constexpr unsigned kGroupBytes = kGroupVec * 16, kStageBytes = kMmaU * kGroupBytes;
  const uint4* mine = smem + warp * S * kMmaU * kGroupVec;
  const unsigned mine_s = static_cast<unsigned>(__cvta_generic_to_shared(mine));
  MmaInputs in(xp, corr, groups, warp, g, t, m);
  const int count = in.count;

  // The copy side walks ahead of the compute side by S - 1 stages; both keep running pointers
  // (64-bit address arithmetic from a group index costs four instructions a pointer).
  int next = 0;  // the next group to copy
  unsigned slot = 0;  // byte offset of the next stage's slot in `mine`
  const uint4* wn = wsrc;
  const float* sn = ssrc;
  auto issue = [&]() {
    const unsigned dst = mine_s + slot;
#pragma unroll
    for (int u = 0; u < kMmaU; ++u) {
      if (next + u < count) {
        cp_async16(dst + u * kGroupBytes + lane * 16, wn + 16 * u);
        if (scale_lane) cp_async4(dst + u * kGroupBytes + 512 + lane * 4, sn + 8 * u);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait count uniform
    next += kMmaU;
    wn += 16 * kMmaU;
    sn += 8 * kMmaU;
    slot = slot + kStageBytes == S * kStageBytes ? 0 : slot + kStageBytes;
  };

  float tot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int st = 0; st < S - 1; ++st) issue();
  const uint4* src = mine;
  for (int i0 = 0; i0 < count; i0 += kMmaU) {
    issue();
    cp_async_wait<S - 1>();
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kMmaU; ++u) {
      if (i0 + u >= count) break;
      const uint2* q = reinterpret_cast<const uint2*>(src + u * kGroupVec);
      const uint2 qa = q[g * 4 + t], qb = q[(g + 8) * 4 + t];
      const float* sc = reinterpret_cast<const float*>(src + u * kGroupVec + 32);
      mma_group(qa, qb, sc[g], sc[g + 8], in, u, tot);
    }
    in.advance(kMmaU);
    src = src + kMmaU * kGroupVec == mine + S * kMmaU * kGroupVec ? mine : src + kMmaU * kGroupVec;
    __syncwarp();  // the slot is refilled by the next issue
  }
  cp_async_wait<0>();
  mma_reduce_store<OT>(red, tot, warp, lane, row0, n, m, y);
}

// ---- Wide tensor-core variant (M <= 4, K a multiple of 128) ---------------------------------
//
// The kernels above give each lane 8 bytes of a row per group, so one warp load touches 8 rows
// for 32 bytes each (and the scale loads 8 rows for 4 bytes each): the L1 handles ~33 lines per
// 512 bytes of codes. Without any arithmetic that pattern reads at 3.4 TB/s on the H200, against
// 4.3 TB/s with 16 bytes a lane and row (bench/read_patterns.py `mma`). Here lane (g, t) loads
// 16 contiguous bytes of row g (and of row g + 8): bytes 16 t .. 16 t + 15 of the row's 64-byte
// piece holding groups 2p and 2p + 1, so lanes t = 0, 1 hold group 2p's codes and t = 2, 3
// group 2p + 1's. An MMA's 16 k positions then span two groups, which the B operand keeps
// apart: column n = 2m + par holds row m of x at the k positions of the lanes with t / 2 == par
// and zeros elsewhere, so D's column n is row m's sum over group 2p + par alone. Eight MMAs
// cover a pair of groups (32 codes of two rows per lane); lane (g, t) ends with rows g and g + 8
// of x row m = t for both groups, each scaled by its row's group scale (one 8-byte load per row
// and pair).
//
// x is read as it is (x [M, K] bf16), 16 bytes at a time; only the lanes whose column is a row
// of x load it (zeros stay in the others' registers). A lane's B register r must hold its
// inputs' pair (r, r + 4) of each 8 (the codes' nibble order, see `pair`): four byte
// permutations of each 16-byte load put them there. (x permuted by the caller so that its
// words are those pairs already, 15% fewer instructions in the main loop, was as correct and
// no faster in the decode step on the H200: the kernel is latency-bound, and XLA's permutation
// adds work before the call.)
//
// The codes come out of `pair` as 128 + q, so the sums need 136 * sum(x) taken off (q - 8 is
// the code's value): corr [M, K/64] fp32 = the group sums of x, computed by the caller; each
// group's sum takes 136 * corr off in one FMA (d - 136 c rounded once). The caller's sums come
// out of the fusion that makes x; a separate x 136 would be one more kernel a call. (One
// more MMA with A = -136 before each of the eight, which needs no sums, doubles the MMAs and
// was slower on the H200: lm_head at M = 1 378.6 us against 303.7.)
// Warps take pairs warp, warp + W, ... of a 16-row tile, P = 2 pairs of codes and scales in
// flight in registers; their sums are added in shared memory in warp order. Column m's result
// does not depend on M (its B column and its A are the same): batch invariant.

// A pair's B registers from x in global memory: lanes holding x load its 64 bytes (16 at a
// time), four byte permutations a load put inputs (r, r + 4) of each 8 together; the other
// lanes hold zeros. `[q]` gives MMA q's two registers.
struct XFragsGlobal {
  uint32_t b[16];
  __device__ __forceinline__ XFragsGlobal(const uint4* __restrict__ xp, bool has_x) {
    if (has_x) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {  // inputs 0..7 -> pairs (0, 4), (1, 5), (2, 6), (3, 7)
        const uint4 xv = __ldg(xp + v);
        b[4 * v] = __byte_perm(xv.x, xv.z, 0x5410);
        b[4 * v + 1] = __byte_perm(xv.x, xv.z, 0x7632);
        b[4 * v + 2] = __byte_perm(xv.y, xv.w, 0x5410);
        b[4 * v + 3] = __byte_perm(xv.y, xv.w, 0x7632);
      }
    } else {
#pragma unroll
      for (int v = 0; v < 16; ++v) b[v] = 0u;
    }
  }
  __device__ __forceinline__ uint2 operator[](int q) const {
    return make_uint2(b[2 * q], b[2 * q + 1]);
  }
};

// A pair's B registers from the block's copy of x in shared memory (`stage_x_shared`): MMA
// q's two registers are 8 bytes at p + 8 q, loaded just before it (lanes without x point at
// a zero block). Two registers live instead of 16, and no permutations.
struct XFragsShared {
  const uint2* p;
  __device__ __forceinline__ uint2 operator[](int q) const { return p[q]; }
};

// One pair of groups of a wide tile for lane (g, t): codes ca (row g) and cb (row g + 8), their
// scales sa and sb; the pair's eight MMAs over the B registers of `xf` (x from global or from
// shared memory: the same registers, the same sums bit for bit), then the scales and the
// group sums of x from `corr()`, called where they are used.
template <typename Frags, typename Corr>
__device__ __forceinline__ void wide_pair_frags(const uint4 ca, const uint4 cb, const float2 sa,
                                                const float2 sb, const Frags& xf, Corr corr,
                                                float (&tot)[2]) {
  const uint32_t wq[4] = {ca.x, ca.y, ca.z, ca.w};
  const uint32_t wr[4] = {cb.x, cb.y, cb.z, cb.w};
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int e = 2 * (q & 1);
    const uint2 b = xf[q];
    mma_bf16(d, pair(wq[q >> 1], e), pair(wr[q >> 1], e), pair(wq[q >> 1], e + 1),
             pair(wr[q >> 1], e + 1), b.x, b.y);
  }
  const float2 c = corr();  // group sums 2p, 2p + 1 of x row t
  tot[0] = fmaf(sa.x, fmaf(-136.0f, c.x, d[0]), tot[0]);
  tot[0] = fmaf(sa.y, fmaf(-136.0f, c.y, d[1]), tot[0]);
  tot[1] = fmaf(sb.x, fmaf(-136.0f, c.x, d[2]), tot[1]);
  tot[1] = fmaf(sb.y, fmaf(-136.0f, c.y, d[3]), tot[1]);
}

// A tile's warp sums added in shared memory in warp order: the result is warp 0's. A block
// that reduces tile after tile alternates two `red` buffers, so one barrier a tile suffices.
template <int W>
__device__ __forceinline__ float2 tile_sums(float2 (&red)[W][32], const float (&tot)[2],
                                            int warp, int lane) {
  red[warp][lane] = make_float2(tot[0], tot[1]);
  __syncthreads();
  float2 s = make_float2(0.0f, 0.0f);
  if (warp == 0) {
    s = red[0][lane];
#pragma unroll
    for (int v = 1; v < W; ++v) {
      const float2 o = red[v][lane];
      s.x += o.x;
      s.y += o.y;
    }
  }
  return s;
}

// A wide tile's warp sums added in shared memory in warp order and stored by warp 0.
template <int W, typename OT>
__device__ __forceinline__ void wide_reduce_store(float2 (&red)[W][32], const float (&tot)[2],
                                                  int warp, int lane, int row0, int n, int m,
                                                  OT* __restrict__ y) {
  const float2 s = tile_sums<W>(red, tot, warp, lane);
  if (warp == 0) {
    const int g = lane >> 2, t = lane & 3;
    const int ra = row0 + g, rb = ra + 8;
    if (t < m) {
      if (ra < n) y[static_cast<int64_t>(t) * n + ra] = to_out<OT>(s.x);
      if (rb < n) y[static_cast<int64_t>(t) * n + rb] = to_out<OT>(s.y);
    }
  }
}

// One warp's codes and scales of a 16-row tile (rows row0 .. row0 + 15 of mt) and how many of
// its pairs the warp takes; count 0: no tile. The warp's i-th pair is pair warp + W i: the
// lane's codes at byte 64 (warp + W i) + 16 t of the row (+ 4 W uint4 per i), the pair's two
// scales at float2 warp + W i.
template <int W>
struct WideTile {
  const uint4 *pa = nullptr, *pb = nullptr;
  const float2 *qa = nullptr, *qb = nullptr;
  int count = 0;

  __device__ __forceinline__ WideTile() {}
  __device__ __forceinline__ WideTile(const Mats& mt, int64_t layer, int k, int row0, int warp,
                                      int lane) {
    const int n = mt.start[mt.count], g = lane >> 2, t = lane & 3, pairs = k >> 7;
    const uint8_t *wa, *wb;
    const float *sa_p, *sb_p;
    row_ptrs(mt, min(row0 + g, n - 1), layer, k, wa, sa_p);
    row_ptrs(mt, min(row0 + g + 8, n - 1), layer, k, wb, sb_p);
    pa = reinterpret_cast<const uint4*>(wa + warp * 64) + t;
    pb = reinterpret_cast<const uint4*>(wb + warp * 64) + t;
    qa = reinterpret_cast<const float2*>(sa_p) + warp;
    qb = reinterpret_cast<const float2*>(sb_p) + warp;
    count = warp < pairs ? (pairs - warp + W - 1) / W : 0;
  }
};

// The register ring of P pairs in flight (slot j holds items j, j + P, ... of a tile).
template <int P>
struct WideRing {
  uint4 ca[P], cb[P];
  float2 sa[P], sb[P];
};

// kCoherent: through the coherent path, for a fill that must stay ahead of a
// `griddepcontrol.wait` (the MLP's down launch).
template <int P, int W, bool kCoherent = false>
__device__ __forceinline__ void ring_fill(WideRing<P>& r, const WideTile<W>& tl) {
#pragma unroll
  for (int j = 0; j < P; ++j) {
    if (j < tl.count) {
      if constexpr (kCoherent) {
        r.ca[j] = load_stream_coherent(tl.pa + 4 * W * j);
        r.cb[j] = load_stream_coherent(tl.pb + 4 * W * j);
        r.sa[j] = load_coherent(tl.qa + W * j);
        r.sb[j] = load_coherent(tl.qb + W * j);
      } else {
        r.ca[j] = load_stream(tl.pa + 4 * W * j);
        r.cb[j] = load_stream(tl.pb + 4 * W * j);
        r.sa[j] = __ldg(tl.qa + W * j);
        r.sb[j] = __ldg(tl.qb + W * j);
      }
    }
  }
}

// Where a warp's pairs find their group sums of x: `at(j)` for the j-th pair from the
// current one, `step(n)` moves n pairs on. CorrPairs: corr [M, K/64] as float2 a pair;
// CorrTiles: 4 sums of 16 rows a group (the MLP's down), added in a fixed order. Both through
// the read-only path.
template <int W>
struct CorrPairs {
  const float2* p;
  __device__ __forceinline__ float2 at(int j) const { return __ldg(p + W * j); }
  __device__ __forceinline__ void step(int n) { p += W * n; }
};
template <int W>
struct CorrTiles {
  const float4* p;
  __device__ __forceinline__ float2 at(int j) const {
    const float4* q = p + 2 * W * j;
    const float4 lo = __ldg(q);
    const float4 hi = __ldg(q + 1);
    return make_float2(((lo.x + lo.y) + lo.z) + lo.w, ((hi.x + hi.y) + hi.z) + hi.w);
  }
  __device__ __forceinline__ void step(int n) { p += 2 * W * n; }
};

// Ring slot j with the pair P ahead of it (codes at pa / pb, scales at qa / qb: the round's).
template <int P, int W>
__device__ __forceinline__ void ring_refill(WideRing<P>& r, int j, const uint4* pa,
                                            const uint4* pb, const float2* qa,
                                            const float2* qb) {
  r.ca[j] = load_stream(pa + 4 * W * (j + P));
  r.cb[j] = load_stream(pb + 4 * W * (j + P));
  r.sa[j] = __ldg(qa + W * (j + P));
  r.sb[j] = __ldg(qb + W * (j + P));
}

// Where a warp's pairs find x, `frags(j)` for the j-th pair from the current one, `step(n)`
// moving n pairs on: XRunGlobal from x [M, K] in global memory (16 W uint4 a pair),
// XRunShared from the block's copy in shared memory (`step` bytes a pair: 0 for a lane
// without x, which reads the zero block throughout).
template <int W>
struct XRunGlobal {
  const uint4* p;
  bool has_x;
  __device__ __forceinline__ XFragsGlobal frags(int j) const {
    return XFragsGlobal(p + 16 * W * j, has_x);
  }
  __device__ __forceinline__ void step(int n) { p += 16 * W * n; }
};
struct XRunShared {
  const unsigned char* p;
  int step_bytes;
  __device__ __forceinline__ XFragsShared frags(int j) const {
    return XFragsShared{reinterpret_cast<const uint2*>(p + j * step_bytes)};
  }
  __device__ __forceinline__ void step(int n) { p += n * step_bytes; }
};

// No work at a round's start (ring_run_x's `round`; bench/gemv_lab.cu stamps a timer there).
struct NoRound {
  __device__ __forceinline__ void operator()() const {}
};

// The warp's pairs of one tile, from the ring (filled with the tile's first P), refilling
// it from the same tile; x and corr at the warp's first pair; `round()` at the start of each
// round of P pairs.
template <int P, int W, bool kFull, typename X, typename Corr, typename Round = NoRound>
__device__ __forceinline__ void ring_run_x(WideRing<P>& r, const WideTile<W>& tl, X x,
                                           Corr corr, float (&tot)[2], Round round = {}) {
  const uint4 *pa = tl.pa, *pb = tl.pb;
  const float2 *qa = tl.qa, *qb = tl.qb;
  int i0 = 0;
  // What the ring buys, by the sm_90 SASS: ptxas puts every refill on one scoreboard
  // and waits for codes with a full drain of it (no partial DEPBAR), so in the conditional
  // loop a pair's first use of its codes also waits for the refill issued just before it,
  // and in the full rounds the refills sink to the round's end and are waited for at the
  // next round's start: the ring hides about one pair's work, whatever P. With the refills
  // left out (a diagnostic build, almost no HBM traffic) a call keeps 74-80% of its time, so the
  // warps' own work a pair, not the bytes in flight, is most of what holds it.
  // kFull: full rounds first, every slot computed and refilled with no branch between the
  // pairs, so the compiler may overlap a pair's loads of x and corr with the MMAs of the pair
  // before (with a branch a pair, each pair's chain runs alone). The same pairs in the same
  // order: the same sums, bit for bit.
  for (; kFull && i0 + 2 * P <= tl.count; i0 += P) {
    round();
#pragma unroll
    for (int j = 0; j < P; ++j) {
      wide_pair_frags(r.ca[j], r.cb[j], r.sa[j], r.sb[j], x.frags(j),
                      [&corr, j]() { return corr.at(j); }, tot);
      ring_refill<P, W>(r, j, pa, pb, qa, qb);
    }
    pa += 4 * W * P;
    pb += 4 * W * P;
    qa += W * P;
    qb += W * P;
    x.step(P);
    corr.step(P);
  }
  for (; i0 < tl.count; i0 += P) {
    round();
#pragma unroll
    for (int j = 0; j < P; ++j) {
      if (i0 + j < tl.count) {  // the same for the whole warp
        wide_pair_frags(r.ca[j], r.cb[j], r.sa[j], r.sb[j], x.frags(j),
                        [&corr, j]() { return corr.at(j); }, tot);
        if (i0 + j + P < tl.count)  // the slot is free: refill it with the pair P ahead
          ring_refill<P, W>(r, j, pa, pb, qa, qb);
      }
    }
    pa += 4 * W * P;
    pb += 4 * W * P;
    qa += W * P;
    qb += W * P;
    x.step(P);
    corr.step(P);
  }
}

// ring_run_x over x in global memory at xr (16 W uint4 a pair).
template <int P, int W, bool kFull, typename Corr>
__device__ __forceinline__ void ring_run(WideRing<P>& r, const WideTile<W>& tl,
                                         const uint4* __restrict__ xr, bool has_x, Corr corr,
                                         float (&tot)[2]) {
  ring_run_x<P, W, kFull>(r, tl, XRunGlobal<W>{xr, has_x}, corr, tot);
}

// ---- x staged in shared memory (M = 1) ------------------------------------------------------
// A block's copy of x row 0 [K] for the wide kernels' B registers: pair p's 64 bytes of lane
// quarter t at kXsPair p + 64 t + 8 (t >> 1) (the pad keeps the four lanes holding x on
// different banks), each 8 inputs permuted as the global path permutes them, so that MMA q
// reads 8 bytes at + 8 q; a zero block of 64 bytes after the last pair for the lanes without
// x. The same B registers as the global path: the same sums, bit for bit. A pair's x then
// costs 8 loads of 8 bytes from shared memory against 4 of 16 through L1, 16 permutations
// and 8 zeroings, and 14 fewer live registers. H200: kernel time at M = 1 4-11% lower
// (gate|up-like at 4 warps 32.1 against 36.1 us); in the decode step the wide calls' time
// alone on the GPU 137 us lower (1,871 against 2,008 us).
constexpr int kXsPair = 272;
// Full rounds (ring_run) at every staged call: with x from shared memory they are faster at
// the full-wave calls too (gate|up 34816 x 5120 at 4 warps 32.5 against 36.2 us).
constexpr bool kXsFull = true;
// The MLP op's launches do not stage x (H200): gate|up's staging made the op slower alone (60.05
// against 58.62 us at M = 1); down's made it 1.2 us faster alone but 117 us a step slower in
// the step's profile, where down's early part overlaps gate|up's tail and its staging sits
// after the `griddepcontrol.wait`.
// The largest K staged: its copy (43.6 KB at 20480) and a kernel's static reduction buffers
// (up to 4 KB) within the 48 KB a block gets without opting in.
constexpr int kXsMaxK = 20480;
static_assert(kXsPair * (kXsMaxK >> 7) + 64 + 4096 <= 48 * 1024, "staged x past 48 KB");

__host__ __device__ constexpr int xs_bytes(int k) { return kXsPair * (k >> 7) + 64; }
// Whether a wide call stages x: one row of x, K small enough.
__host__ __device__ constexpr bool xs_for(int m, int k) { return m == 1 && k <= kXsMaxK; }

// The block's threads copy x [K] (natural order, read-only path) into xs; a barrier after.
__device__ __forceinline__ void stage_x_shared(unsigned char* xs, const uint4* __restrict__ x,
                                               int k) {
  const int pairs = k >> 7;
  for (int j = threadIdx.x; j < pairs * 16; j += blockDim.x) {
    const uint4 v = __ldg(x + j);
    const int p = j >> 4, t = (j >> 2) & 3, u = j & 3;
    uint2* d = reinterpret_cast<uint2*>(xs + kXsPair * p + 64 * t + 8 * (t >> 1) + 16 * u);
    d[0] = make_uint2(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632));
    d[1] = make_uint2(__byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
  }
  if (threadIdx.x < 8) reinterpret_cast<uint2*>(xs + kXsPair * pairs)[threadIdx.x] = uint2{};
  __syncthreads();
}

// Lane `lane` of warp `warp` (of W) over the staged copy: its first pair and its step.
template <int W>
__device__ __forceinline__ XRunShared xs_run(const unsigned char* xs, int k, int warp,
                                             int lane, bool has_x) {
  const int t = lane & 3;
  return has_x ? XRunShared{xs + kXsPair * warp + 64 * t + 8 * (t >> 1), kXsPair * W}
               : XRunShared{xs + kXsPair * (k >> 7), 0};
}

// Which x row lane (g, t) of a wide tile reads (column g of B: x row g / 2 where (g & 1) ==
// t / 2, the lane's codes being of group 2p + t / 2) and where: x [M, K] (and the MLP's act
// [M, N1]), corr [M, K/64] and the MLP's psum [M, N1/16], each at warp `warp`'s first pair.
struct LaneRows {
  bool has_x;
  int xrow, crow;
  __device__ __forceinline__ LaneRows(int lane, int m) {
    const int g = lane >> 2, t = lane & 3;
    has_x = g < 2 * m && (g & 1) == (t >> 1);
    xrow = min(g >> 1, m - 1);
    crow = min(t, m - 1);
  }
  __device__ __forceinline__ const uint4* x_at(const uint4* x, int k, int warp, int lane) const {
    return x + static_cast<int64_t>(xrow) * (k >> 3) + warp * 16 + 4 * (lane & 3);
  }
  __device__ __forceinline__ const float2* corr_at(const float* corr, int k, int warp) const {
    return reinterpret_cast<const float2*>(corr + static_cast<int64_t>(crow) * (k >> 6)) + warp;
  }
  __device__ __forceinline__ const float4* psum_at(const float* psum, int n1, int warp) const {
    const int64_t tiles = (n1 + 15) / 16;
    return reinterpret_cast<const float4*>(psum + crow * tiles) + 2 * warp;
  }
};

// What lane (g, t) of warp `warp` reads of a wide tile: its rows' codes and scales at its
// first pair (`WideTile`), x and corr at its first pair, whether it holds x.
template <int W>
struct WideLane : WideTile<W> {
  const uint4* xr;   // x (+ 16 W uint4 a pair)
  const float2* cr;  // corr (+ W a pair)
  bool has_x;

  __device__ __forceinline__ WideLane(const uint4* __restrict__ x,
                                      const float* __restrict__ corr, const Mats& mt,
                                      const int32_t* __restrict__ index, int k, int m,
                                      int warp, int lane, int row0)
      : WideTile<W>(mt, layer_of(mt, index), k, row0, warp, lane) {
    const LaneRows rows(lane, m);
    has_x = rows.has_x;
    xr = rows.x_at(x, k, warp, lane);
    cr = rows.corr_at(corr, k, warp);
  }
};

// Programmatic dependent launch (sm_90; no-ops below): `pdl_launch_dependents` lets the next
// launch on the stream, if launched with programmatic stream serialization, start once every
// block of this grid has signalled or exited; its `pdl_wait` returns when this grid has
// finished and its stores are visible. Without the attribute the wait returns at once.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The wide kernel's pairs of codes and scales in flight a warp (P, the `prefetch` attribute).
// On the H200 a deeper register ring (P = 4: 98 registers a lane against 74) or 16 warps a
// tile lower a small call's floor (3.8-4.4 us against 5.4) but slow the large calls (out_proj
// 11.4-13.4 us against 9.6), and a cp.async ring in shared memory (4 or 8 pairs, no registers)
// was slower at every shape: the kernel does not wait on bytes in flight that a deeper ring
// would add.
constexpr int kWidePairs = 2;
// Resident warps an SM the wide kernel's registers are capped for (the `occupancy`
// attribute): 64 a lane, where P = 2 needs no spills (74 without a bound, 24 warps an SM).
// More warps, more codes in flight. H200: faster at most of the step's shapes (lm_head at
// M = 1 243.0 against 270.8 us at 4 warps, down 31.7 against 36.3 at 8; gate|up 52.4 against
// 49.0 at 4 the exception), and in the decode step (C1 / C2 at 1K 119.6 / 227.6 tok/s against
// 110.8 / 216.5 uncapped).
constexpr int kWideOccupancy = 32;

// W warps to a 16-row tile (4 or 8), registers capped for kWideOccupancy warps an SM
// (kWideOccupancy / W blocks).
// kXs: x (M = 1) staged in shared memory (`stage_x_shared`, xs_bytes(k) of dynamic shared
// memory), while the ring's first codes are in flight.
template <int W, typename OT, bool kXs>
__global__ void __launch_bounds__(W * 32, kWideOccupancy / W)
    int4_gemv_wide(const uint4* __restrict__ x, const float* __restrict__ corr,
                   const __grid_constant__ Mats mt, const int32_t* __restrict__ index,
                   OT* __restrict__ y, int k, int m) {
  constexpr int P = kWidePairs;
  __shared__ float2 red[W][32];
  extern __shared__ __align__(16) unsigned char xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * 16;
  const WideLane<W> in(x, corr, mt, index, k, m, warp, lane, row0);
  WideRing<P> ring;
  ring_fill(ring, static_cast<const WideTile<W>&>(in));
  float tot[2] = {0.0f, 0.0f};  // rows g and g + 8 of x row t
  if constexpr (kXs) {
    stage_x_shared(xs, x, k);
    ring_run_x<P, W, kXsFull>(ring, in, xs_run<W>(xs, k, warp, lane, in.has_x),
                              CorrPairs<W>{in.cr}, tot);
  } else {
    ring_run<P, W, full_rounds(W >= 8)>(ring, in, in.xr, in.has_x, CorrPairs<W>{in.cr}, tot);
  }
  wide_reduce_store<W, OT>(red, tot, warp, lane, row0, mt.start[mt.count], m, y);
}

// ---- The MLP for decode (M <= 4): gate|up, SwiGLU, down and the residual ------------------
//
// A decode step's MLP is two dependent GEMVs (gate|up 34816 x 5120, down 5120 x 17408 for the
// 27B) with small XLA kernels around them; each GEMV call pays a ramp (the first codes'
// latency) and a tail (its last blocks) of ~6-10 us on the H200 (ncu). Here they run as
// two launches chained by programmatic dependent launch (sm_90):
// - int4_mlp_gate_up: block u reduces gate tile u and up tile u (the wide kernel's tile loop
//   and reduction for each, the ring running on from one to the other), then act = SwiGLU of
//   the two (bf16, rounded as XLA's silu(gate) * up of bf16 GEMV outputs) and the tile's sums
//   of act for each x row, into `act` [M, N1] and `psum` [M, N1 / 16]. Each block first
//   signals `griddepcontrol.launch_dependents`, so the down launch may start once every block
//   of this grid has begun;
// - int4_mlp_down (launched with programmaticStreamSerialization): block v fills its ring
//   with down tile v's first codes and scales (weights: they do not depend on this MLP's
//   act), then `griddepcontrol.wait`s for the gate|up grid to finish and its stores to be
//   visible, then reduces the tile over act (through the read-only path: L1 hits for the
//   blocks of an SM, as the wide kernel's x) with down's group sums of act from psum (4 tile
//   sums a group, added in a fixed order), and adds the residual: out = h + y (bf16).
// Down's blocks become resident as gate|up's last blocks leave, so its ramp overlaps gate|up's
// tail, with no co-residency requirement and no counters: launches may overlap. A row's
// result depends on its own x row only: batch invariant.
// H200: the programmatic dependent launch is worth ~1-9 us a call against the same two
// launches in stream order, and the op 1.1-1.9% C1 and 2.6-4.7% C2 decode (1K) against the
// separate calls. One persistent launch with a grid barrier between the GEMVs lost to the
// separate calls (C1 / C2 at 1K 112.7 / 209.3 tok/s against 122.4 / 234.3): it must read act,
// written in the same launch, through L2, on every x load's critical path.
//
// Warps a tile of both launches (down's few tiles want the most warps, as the wide kernel's
// choice for few tiles) and the resident warps an SM the registers are capped for (the
// `warps` and `occupancy` attributes): gate|up at 8 / 32 was the fastest of 8 / 32, 4 / 24
// and 4 / 32 in the decode step (C1 / C2 at 1K 123.3 / 241.3 tok/s; 4 / 24: 123.0 / 232.3).
constexpr int kMlpWarps = 8;
constexpr int kMlpOccupancy = 32;

__device__ __forceinline__ float bf16_round(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// silu(gate) * up as XLA computes it from the GEMV's bf16 outputs: each op rounded to bf16
__device__ __forceinline__ float swiglu_bf16(float gate_sum, float up_sum) {
  const float g = bf16_round(gate_sum), u = bf16_round(up_sum);
  const float sig = bf16_round(1.0f / (1.0f + expf(-g)));
  return bf16_round(bf16_round(g * sig) * u);
}

// Warp 0 of the block that reduced gate tile u (sums `gate`) and up tile u (sums `up`): act =
// SwiGLU of rows 16u + g and 16u + g + 8 for x row t, and the tile's sum of act for x row t
// (over g in a fixed tree) into psum [M, N1 / 16].
__device__ __forceinline__ void mlp_act_store(float2 gate, float2 up, int u, int n1, int m,
                                              int lane, __nv_bfloat16* act, float* psum) {
  const int g = lane >> 2, t = lane & 3, ra = 16 * u + g, rb = ra + 8;
  const float a0 = t < m && ra < n1 ? swiglu_bf16(gate.x, up.x) : 0.0f;
  const float a1 = t < m && rb < n1 ? swiglu_bf16(gate.y, up.y) : 0.0f;
  if (t < m && ra < n1) act[static_cast<int64_t>(t) * n1 + ra] = __float2bfloat16_rn(a0);
  if (t < m && rb < n1) act[static_cast<int64_t>(t) * n1 + rb] = __float2bfloat16_rn(a1);
  float p = a0 + a1;
  p += __shfl_xor_sync(0xffffffffu, p, 4);
  p += __shfl_xor_sync(0xffffffffu, p, 8);
  p += __shfl_xor_sync(0xffffffffu, p, 16);
  if (g == 0 && t < m) psum[static_cast<int64_t>(t) * ((n1 + 15) / 16) + u] = p;
}

// Warp 0 of the block that reduced down's tile at row0 (sums s): out = h + the sums, rows
// row0 + g and row0 + g + 8 of x row t, each rounded to bf16 as the separate calls round.
__device__ __forceinline__ void mlp_out_store(float2 s, int row0, int n2, int m, int lane,
                                              const __nv_bfloat16* __restrict__ h,
                                              __nv_bfloat16* __restrict__ out) {
  const int g = lane >> 2, t = lane & 3, ra = row0 + g, rb = ra + 8;
  if (t < m) {
    const int64_t o = static_cast<int64_t>(t) * n2;
    if (ra < n2)
      out[o + ra] = __float2bfloat16_rn(__bfloat162float(h[o + ra]) + bf16_round(s.x));
    if (rb < n2)
      out[o + rb] = __float2bfloat16_rn(__bfloat162float(h[o + rb]) + bf16_round(s.y));
  }
}

__global__ void __launch_bounds__(kMlpWarps * 32, kMlpOccupancy / kMlpWarps)
    int4_mlp_gate_up(const uint4* __restrict__ x, const float* __restrict__ corr,
                     const __grid_constant__ Mats gu, const int32_t* __restrict__ index,
                     __nv_bfloat16* __restrict__ act, float* __restrict__ psum, int k1,
                     int m) {
  constexpr int W = kMlpWarps;
  pdl_launch_dependents();
  __shared__ float2 red[2][W][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, u = blockIdx.x;
  const int n1 = gu.start[1];
  const int64_t layer = layer_of(gu, index);
  const LaneRows ln(lane, m);
  const uint4* xa = ln.x_at(x, k1, warp, lane);
  const float2* ca = ln.corr_at(corr, k1, warp);
  WideRing<2> ring;
  WideTile<W> cur(gu, layer, k1, 16 * u, warp, lane);
  ring_fill(ring, cur);
  float gt[2] = {0.0f, 0.0f}, ut[2] = {0.0f, 0.0f};
  auto run = [&](float(&tot)[2]) {
    ring_run<2, W, full_rounds(false)>(ring, cur, xa, ln.has_x, CorrPairs<W>{ca}, tot);
  };
  run(gt);
  cur = WideTile<W>(gu, layer, k1, n1 + 16 * u, warp, lane);  // up's tile u in flight
  ring_fill(ring, cur);
  const float2 gate = tile_sums<W>(red[0], gt, warp, lane);
  run(ut);
  const float2 up = tile_sums<W>(red[1], ut, warp, lane);
  if (warp == 0) mlp_act_store(gate, up, u, n1, m, lane, act, psum);
}

__global__ void __launch_bounds__(kMlpWarps * 32, kMlpOccupancy / kMlpWarps)
    int4_mlp_down(const __nv_bfloat16* __restrict__ h, const __grid_constant__ Mats dn,
                  const int32_t* __restrict__ index, const __nv_bfloat16* act,
                  const float* psum, __nv_bfloat16* __restrict__ out, int k2, int m) {
  constexpr int W = kMlpWarps;
  __shared__ float2 red[W][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = 16 * blockIdx.x;
  const LaneRows ln(lane, m);
  WideRing<2> ring;
  const int64_t layer = layer_of<true>(dn, index);
  const WideTile<W> tl(dn, layer, k2, row0, warp, lane);
  ring_fill<2, W, true>(ring, tl);
  // act and psum: the gate|up grid's, complete and visible from here on, so read through the
  // read-only path (L1 hits for the blocks of an SM, as the wide kernel's x)
  pdl_wait();
  float tot[2] = {0.0f, 0.0f};
  ring_run<2, W, full_rounds(true)>(
      ring, tl, ln.x_at(reinterpret_cast<const uint4*>(act), k2, warp, lane), ln.has_x,
      CorrTiles<W>{ln.psum_at(psum, k2, warp)}, tot);
  const float2 s = tile_sums<W>(red, tot, warp, lane);
  if (warp == 0) mlp_out_store(s, row0, dn.start[dn.count], m, lane, h, out);
}

// A launch configuration on `stream` with programmatic stream serialization (cfg points into
// the object: not to be copied).
struct PdlLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  PdlLaunch(const PdlLaunch&) = delete;
  PdlLaunch& operator=(const PdlLaunch&) = delete;
  PdlLaunch(cudaStream_t stream, int blocks, int threads) {
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
};

// The two launches: gate|up, then down with programmatic stream serialization (on a GPU
// without it the wait returns at once and stream order holds).
cudaError_t launch_mlp_pdl(cudaStream_t stream, const uint4* x, const float* corr,
                           const __nv_bfloat16* h, const Mats& gu, const Mats& dn,
                           const int32_t* index, __nv_bfloat16* act, float* psum,
                           __nv_bfloat16* out, int k1, int m) {
  const int n1 = gu.start[1], n2 = dn.start[dn.count];
  int4_mlp_gate_up<<<(n1 + 15) / 16, kMlpWarps * 32, 0, stream>>>(x, corr, gu, index, act,
                                                                  psum, k1, m);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  PdlLaunch b(stream, (n2 + 15) / 16, kMlpWarps * 32);
  return cudaLaunchKernelEx(&b.cfg, int4_mlp_down, h,
                            dn, index, static_cast<const __nv_bfloat16*>(act),
                            static_cast<const float*>(psum), out, n1, m);
}

template <int W, typename OT, bool kXs>
cudaError_t launch_wide(cudaStream_t stream, int blocks, const uint4* x, const float* corr,
                        const Mats& mt, const int32_t* index, void* y, int k, int m) {
  int4_gemv_wide<W, OT, kXs><<<blocks, W * 32, kXs ? xs_bytes(k) : 0, stream>>>(
      x, corr, mt, index, static_cast<OT*>(y), k, m);
  return cudaGetLastError();
}

// The wide kernel with W = `warps` (4 or 8) warps to a 16-row tile, x staged in shared memory
// where the call has one row of x (xs_for). The caller picks W by the call's tiles
// (cuda_ops.wide_warps: 4 for 896 tiles and more, 8 for the 320-384 of down and out_proj).
// Other W measured on the H200: 16 slower than 8 everywhere (lm_head at M = 1 325.6 us against
// 292.5, down 53.4 against 43.8); 10 for the 320 tiles of down and out_proj (all resident at
// once on 132 SMs) 4% faster a call under ncu, no faster in the decode step; 2 (longer runs of
// pairs a warp, less of the block's fixed cost) slower in the decode step than 4 or 8 by
// shape.
template <typename OT>
cudaError_t launch_wide_warps(cudaStream_t stream, int64_t warps, int blocks, const uint4* x,
                              const float* corr, const Mats& mt, const int32_t* index, void* y,
                              int k, int m) {
  const bool xs = xs_for(m, k);
  if (warps == 4)
    return xs ? launch_wide<4, OT, true>(stream, blocks, x, corr, mt, index, y, k, m)
              : launch_wide<4, OT, false>(stream, blocks, x, corr, mt, index, y, k, m);
  return xs ? launch_wide<8, OT, true>(stream, blocks, x, corr, mt, index, y, k, m)
            : launch_wide<8, OT, false>(stream, blocks, x, corr, mt, index, y, k, m);
}

template <typename OT>
cudaError_t launch_mma(cudaStream_t stream, int blocks, const uint4* x4, const float2* c2,
                       const Mats& mt, const int32_t* index, void* y, int k, int m) {
  constexpr int bytes = kMmaSmemBytes;
  static const cudaError_t attr = cudaFuncSetAttribute(
      int4_gemv_mma<OT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (attr != cudaSuccess) return attr;
  int4_gemv_mma<OT><<<blocks, kMmaWarps * 32, bytes, stream>>>(
      x4, c2, mt, index, static_cast<OT*>(y), k, m);
  return cudaGetLastError();
}

struct Launch {
  const float4* x;
  Mats mt;
  const int32_t* index;
  void* y;
  int n, k;
};

template <int M, int R, typename OT>
cudaError_t launch(cudaStream_t stream, const Launch& a) {
  static_assert(R == 1 || R == 2, "rows a warp: 1 or 2");
  constexpr int U = R == 1 ? 8 : 4;  // 128 bytes of weights in flight per lane
  const int rows_per_block = kWarps * R;
  const int blocks = (a.n + rows_per_block - 1) / rows_per_block;
  int4_gemv<M, R, U, OT><<<blocks, kWarps * 32, 0, stream>>>(a.x, a.mt, a.index,
                                                               static_cast<OT*>(a.y), a.k);
  return cudaGetLastError();
}

// The FMA kernel's output rows a warp for M rows of x (the `rows_per_warp` attribute): 2 up to
// 4 rows of x, where the registers allow it without spilling, else 1. (1 and 4 rows a warp at
// small M measured no faster on the H200: every variant stops near 2.1 TB/s on the large
// matrices.)
__host__ __device__ constexpr int fma_rows_per_warp(int m) { return m <= 4 ? 2 : 1; }

template <typename OT>
cudaError_t by_m(cudaStream_t stream, const Launch& a, int m) {
  switch (m) {
    case 1: return launch<1, fma_rows_per_warp(1), OT>(stream, a);
    case 2: return launch<2, fma_rows_per_warp(2), OT>(stream, a);
    case 3: return launch<3, fma_rows_per_warp(3), OT>(stream, a);
    case 4: return launch<4, fma_rows_per_warp(4), OT>(stream, a);
    case 5: return launch<5, fma_rows_per_warp(5), OT>(stream, a);
    case 6: return launch<6, fma_rows_per_warp(6), OT>(stream, a);
    case 7: return launch<7, fma_rows_per_warp(7), OT>(stream, a);
    case 8: return launch<8, fma_rows_per_warp(8), OT>(stream, a);
    default: return cudaErrorInvalidValue;
  }
}

// The weights of a call: pairs (codes, scales) in `rest`, all with the same stack dims and K.
// Fills `mt`; returns an error message or nullptr.
// The (codes, scales) pairs rest[2 first ..] (`pairs` of them, all of rest by default).
const char* decode_mats(const ffi::RemainingArgs& rest, const ffi::Buffer<ffi::S32>& index,
                        Mats& mt, int64_t& k_out, size_t first = 0, size_t pairs = 0) {
  if (pairs == 0) pairs = (rest.size() - 2 * first) / 2;
  if (rest.size() < 2 * (first + pairs) || rest.size() % 2 != 0 || pairs < 1 ||
      pairs > kMaxMats)
    return "int4_gemv: weights come as 1..4 (codes, scales) pairs";
  int64_t nlead = -1, k = -1, rows = 0;
  std::vector<int64_t> lead;
  mt.count = static_cast<int>(pairs);
  for (int j = 0; j < mt.count; ++j) {
    auto w = rest.get<ffi::Buffer<ffi::U8>>(2 * (first + j));
    auto sc = rest.get<ffi::Buffer<ffi::F32>>(2 * (first + j) + 1);
    if (w.has_error() || sc.has_error()) return "int4_gemv: codes must be u8, scales f32";
    const auto wd = w->dimensions(), sd = sc->dimensions();
    const int64_t nl = static_cast<int64_t>(wd.size()) - 2;
    if (nl < 0 || nl > 3) return "int4_gemv: codes must be [*lead (<= 3 dims), N, K/2]";
    const int64_t kj = wd[nl + 1] * 2;
    if (j == 0) {
      nlead = nl;
      k = kj;
      lead.assign(wd.begin(), wd.begin() + nl);
    } else if (nl != nlead || kj != k || !std::equal(lead.begin(), lead.end(), wd.begin())) {
      return "int4_gemv: all weights of a call need the same stack dims and K";
    }
    if (k % 64 != 0) return "int4_gemv: K must be a multiple of 64";
    if (static_cast<int64_t>(sd.size()) != nl + 2 || sd[nl] != wd[nl] || sd[nl + 1] != k / 64 ||
        !std::equal(lead.begin(), lead.end(), sd.begin()))
      return "int4_gemv: scales must be [*lead, N, K/64]";
    mt.w[j] = w->typed_data();
    mt.s[j] = sc->typed_data();
    mt.start[j] = static_cast<int>(rows);
    rows += wd[nl];
  }
  if (rows >= (int64_t{1} << 31) || k >= (int64_t{1} << 31))
    return "int4_gemv: N and K must fit in int32";
  mt.start[mt.count] = static_cast<int>(rows);
  mt.nlead = static_cast<int>(nlead);
  if (index.element_count() < static_cast<size_t>(nlead))
    return "int4_gemv: index needs one entry per stack dim";
  for (int64_t d = 0; d < 3; ++d) {
    int64_t mult = 1;
    for (int64_t e = d + 1; e < nlead; ++e) mult *= lead[e];
    mt.l[d] = d < nlead ? mult : 0;
  }
  k_out = k;
  return nullptr;
}

ffi::Error Int4GemvImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::S32> index, ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> y, int64_t rows_per_warp) {
  Launch a{reinterpret_cast<const float4*>(x.typed_data()), {}, index.typed_data(),
           y->untyped_data(), 0, 0};
  int64_t k = 0;
  if (const char* bad = decode_mats(rest, index, a.mt, k)) return ffi::Error::InvalidArgument(bad);
  const int64_t n = a.mt.start[a.mt.count];
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 6 || xd[1] != (k + 1023) / 1024 || xd[2] != 4 || xd[3] != 2 || xd[4] != 32 ||
      xd[5] != 4)
    return ffi::Error::InvalidArgument("int4_gemv: x must be permuted [M, K/1024, 4, 2, 32, 4]");
  const int64_t m = xd[0];
  if (m < 1 || m > 8) return ffi::Error::InvalidArgument("int4_gemv: M must be 1..8");
  if (yd.size() != 2 || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("int4_gemv: y must be [M, N]");
  if (rows_per_warp != fma_rows_per_warp(static_cast<int>(m)))
    return ffi::Error::InvalidArgument(
        "int4_gemv: built for rows_per_warp 2 (M <= 4) or 1 (M 5..8) only, got " +
        std::to_string(rows_per_warp) + " at M = " + std::to_string(m));
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  cudaError_t err;
  switch (y->element_type()) {
    case ffi::DataType::F32:
      err = by_m<float>(stream, a, static_cast<int>(m));
      break;
    case ffi::DataType::BF16:
      err = by_m<__nv_bfloat16>(stream, a, static_cast<int>(m));
      break;
    default:
      return ffi::Error::InvalidArgument("int4_gemv: y must be f32 or bf16");
  }
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error Int4GemvMmaImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> xp,
                           ffi::Buffer<ffi::F32> corr, ffi::Buffer<ffi::S32> index,
                           ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> y,
                           int64_t stages, int64_t prefetch) {
  if (stages != kMmaStages || prefetch != 0)
    return ffi::Error::InvalidArgument(
        "int4_gemv_mma: built for stages 4, prefetch 0 only, got stages " +
        std::to_string(stages) + ", prefetch " + std::to_string(prefetch));
  Mats mt{};
  int64_t k = 0;
  if (const char* bad = decode_mats(rest, index, mt, k)) return ffi::Error::InvalidArgument(bad);
  const int64_t n = mt.start[mt.count], groups = k / 64;
  const auto xd = xp.dimensions(), cd = corr.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || xd[0] != groups || xd[1] != 8 || xd[2] != 4 || xd[3] != 16)
    return ffi::Error::InvalidArgument("int4_gemv_mma: xp must be [K/64, 8, 4, 16]");
  if (cd.size() != 2 || cd[0] != groups || cd[1] != 8)
    return ffi::Error::InvalidArgument("int4_gemv_mma: corr must be [K/64, 8]");
  if (yd.size() != 2 || yd[1] != n || yd[0] < 1 || yd[0] > 8)
    return ffi::Error::InvalidArgument("int4_gemv_mma: y must be [M <= 8, N]");
  const int blocks = static_cast<int>((n + 15) / 16);
  const auto* x4 = reinterpret_cast<const uint4*>(xp.typed_data());
  const auto* c2 = reinterpret_cast<const float2*>(corr.typed_data());
  const int m = static_cast<int>(yd[0]), ki = static_cast<int>(k);
  const bool bf16 = y->element_type() == ffi::DataType::BF16;
  if (!bf16 && y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("int4_gemv_mma: y must be f32 or bf16");
  void* yp = y->untyped_data();
  const cudaError_t err =
      bf16 ? launch_mma<__nv_bfloat16>(stream, blocks, x4, c2, mt, index.typed_data(), yp, ki, m)
           : launch_mma<float>(stream, blocks, x4, c2, mt, index.typed_data(), yp, ki, m);
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}


bool is_matrix(ffi::Span<const int64_t> d, int64_t rows, int64_t cols) {
  return d.size() == 2 && d[0] == rows && d[1] == cols;
}

// The operands of the wide kernel's call: x [M, K] bf16 as it is, corr [M, K/64] its group
// sums, y [M <= 4, N] f32 or bf16, K a multiple of 128. M, or 0 with `why` set.
int64_t wide_operands(const ffi::Buffer<ffi::BF16>& x, const ffi::Buffer<ffi::F32>& corr,
                      ffi::Span<const int64_t> yd, ffi::DataType yt, int64_t n, int64_t k,
                      std::string& why) {
  const auto xd = x.dimensions();
  const int64_t m = yd.size() == 2 ? yd[0] : 0;
  if (k % 128 != 0)
    why = "K must be a multiple of 128";
  else if (yd.size() != 2 || yd[1] != n || m < 1 || m > 4)
    why = "y must be [M <= 4, N]";
  else if (xd.size() != 2 || xd[0] != m || xd[1] != k)
    why = "x must be [M, K]";
  else if (!is_matrix(corr.dimensions(), m, k / 64))
    why = "corr must be [M, K/64]";
  else if (yt != ffi::DataType::BF16 && yt != ffi::DataType::F32)
    why = "y must be f32 or bf16";
  return why.empty() ? m : 0;
}

ffi::Error Int4GemvWideImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::F32> corr, ffi::Buffer<ffi::S32> index,
                            ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> y,
                            int64_t prefetch, int64_t warps, int64_t bias, int64_t occupancy,
                            int64_t stages, int64_t xperm) {
  if (prefetch != kWidePairs || (warps != 4 && warps != 8) || bias != 0 ||
      occupancy != kWideOccupancy || stages != 0 || xperm != 0)
    return ffi::Error::InvalidArgument(
        "int4_gemv_wide: built for prefetch 2, warps 4 or 8, bias 0, occupancy 32, stages 0, "
        "xperm 0 only, got prefetch " + std::to_string(prefetch) + ", warps " +
        std::to_string(warps) + ", bias " + std::to_string(bias) + ", occupancy " +
        std::to_string(occupancy) + ", stages " + std::to_string(stages) + ", xperm " +
        std::to_string(xperm));
  Mats mt{};
  int64_t k = 0;
  if (const char* bad = decode_mats(rest, index, mt, k)) return ffi::Error::InvalidArgument(bad);
  const int64_t n = mt.start[mt.count];
  std::string why;
  const int64_t m = wide_operands(x, corr, y->dimensions(), y->element_type(), n, k, why);
  if (m == 0) return ffi::Error::InvalidArgument("int4_gemv_wide: " + why);
  const int blocks = static_cast<int>((n + 15) / 16);
  const auto* x4 = reinterpret_cast<const uint4*>(x.typed_data());
  const float* c = corr.typed_data();
  const int mi = static_cast<int>(m), ki = static_cast<int>(k);
  void* yp = y->untyped_data();
  const bool bf16 = y->element_type() == ffi::DataType::BF16;
  const cudaError_t err =
      bf16 ? launch_wide_warps<__nv_bfloat16>(stream, warps, blocks, x4, c, mt,
                                              index.typed_data(), yp, ki, mi)
           : launch_wide_warps<float>(stream, warps, blocks, x4, c, mt, index.typed_data(), yp,
                                      ki, mi);
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

// gate, up and down as (codes, scales) pairs in `rest`, decoded into gu (gate | up) and dn and
// checked against each other; null or why not.
const char* decode_mlp(ffi::RemainingArgs& rest, ffi::Buffer<ffi::S32>& index, Mats& gu,
                       Mats& dn, int64_t& k1) {
  if (rest.size() != 6) return "int4_mlp: gate, up and down as (codes, scales) pairs";
  int64_t k2 = 0;
  if (const char* bad = decode_mats(rest, index, gu, k1, 0, 2)) return bad;
  if (const char* bad = decode_mats(rest, index, dn, k2, 2, 1)) return bad;
  if (gu.start[2] != 2 * gu.start[1]) return "int4_mlp: gate and up need the same rows";
  if (k1 % 128 != 0 || k2 % 128 != 0 || k2 != gu.start[1])
    return "int4_mlp: K of gate|up and of down (= gate's rows) must be multiples of 128";
  return nullptr;
}

// x [M, K1] bf16 (the MLP's normed input), corr [M, K1/64] its group sums, h [M, N2] the
// residual, index, then gate, up and down as (codes, scales) pairs; out = h + down(SwiGLU)
// [M, N2], act [M, N1] and psum [M, N1/16] the launches' scratch. The attributes name the
// build: launches 2 (gate|up then down chained by programmatic dependent launch), warps 8,
// occupancy 32.
ffi::Error Int4MlpImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> corr,
                       ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::S32> index,
                       ffi::RemainingArgs rest, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                       ffi::Result<ffi::Buffer<ffi::BF16>> act,
                       ffi::Result<ffi::Buffer<ffi::F32>> psum, int64_t warps,
                       int64_t occupancy, int64_t launches) {
  if (launches != 2 || warps != kMlpWarps || occupancy != kMlpOccupancy)
    return ffi::Error::InvalidArgument(
        "int4_mlp: built for launches 2, warps 8, occupancy 32 only, got launches " +
        std::to_string(launches) + ", warps " + std::to_string(warps) + ", occupancy " +
        std::to_string(occupancy));
  Mats gu{}, dn{};
  int64_t k1 = 0;
  if (const char* bad = decode_mlp(rest, index, gu, dn, k1))
    return ffi::Error::InvalidArgument(bad);
  const int64_t n1 = gu.start[1], n2 = dn.start[1];
  const auto xd = x.dimensions();
  const int64_t m = xd.size() == 2 ? xd[0] : 0;
  if (m < 1 || m > 4 || xd[1] != k1)
    return ffi::Error::InvalidArgument("int4_mlp: x must be [M <= 4, K1]");
  if (!is_matrix(corr.dimensions(), m, k1 / 64))
    return ffi::Error::InvalidArgument("int4_mlp: corr must be [M, K1/64]");
  if (!is_matrix(h.dimensions(), m, n2) || !is_matrix(out->dimensions(), m, n2))
    return ffi::Error::InvalidArgument("int4_mlp: h and out must be [M, N2]");
  if (!is_matrix(act->dimensions(), m, n1) || !is_matrix(psum->dimensions(), m, n1 / 16))
    return ffi::Error::InvalidArgument("int4_mlp: act must be [M, N1], psum [M, N1/16]");
  const auto* x4 = reinterpret_cast<const uint4*>(x.typed_data());
  const auto* hp = reinterpret_cast<const __nv_bfloat16*>(h.typed_data());
  auto* ap = reinterpret_cast<__nv_bfloat16*>(act->typed_data());
  auto* op = reinterpret_cast<__nv_bfloat16*>(out->typed_data());
  const int ki = static_cast<int>(k1), mi = static_cast<int>(m);
  const cudaError_t err = launch_mlp_pdl(stream, x4, corr.typed_data(), hp, gu, dn,
                                         index.typed_data(), ap, psum->typed_data(), op, ki, mi);
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---- The int4 GEMM of prefill pieces (up to 64 rows of x) ------------------------------------
//
// A short prefill piece (the last tokens of a new turn) multiplies up to 64 rows of bf16 x by
// every weight, so each weight byte is read once for all its rows and the piece costs close to
// its bytes (or, at 64 rows, to its tensor-core work). As in the decode kernels, codes become
// exact bf16 (code - 8) (`pair`, then one bf16 subtraction), the products are exact and summed
// in fp32 by the MMAs a group at a time, and each group's sums are scaled by its fp32 scale
// into the row's total: the sums of exact products (the reference instead rounds each
// code * scale to bf16 first).
//
// A block owns 256 output rows and all Mp = 8 MT rows of x (MT n8 columns of the MMA, MT
// even), over a range of K. Its warps (`GemmWarps`) each take RW m16 row sets (16 RW rows)
// against TW of the n8 tiles: a weight's codes are made bf16 once for each warp that reads
// them (MT / TW times), and x's tiles are read from shared memory once for each row set of
// warps; the grid's y dimension splits K into
// `splits` parts, each writing fp32 partial sums [split, M, N] that the caller adds in split
// order. A stage is 128 inputs (two groups): two threads copy a row's 64 bytes of codes (one
// group each) and one its 8 bytes of scales with cp.async into a ring of gemm_stages(MT)
// stages; x comes in 32-byte pieces through registers (permuted on the way, below).
//
// Within a group, lane (g, t) holds the codes of inputs 16t .. 16t + 15 of its rows, two 32-bit
// words w0 (inputs 16t + 0..7) and w1 (16t + 8..15). MMA step q multiplies pair(w0, q) (inputs
// 16t + q and 16t + q + 4: the A operand's k pair (2t, 2t + 1)) and pair(w1, q) (16t + 8 + q,
// 16t + 12 + q: the k pair (2t + 8, 2t + 9)). B must pair x the same way, so x is stored
// permuted: a lane's 32 bytes of row m are the bf16 pairs (x0, x4), (x8, x12), (x1, x5),
// (x9, x13), (x2, x6), (x10, x14), (x3, x7), (x11, x15) of its 16 inputs, so that its two
// 16-byte loads hold B for steps 0, 1 and 2, 3. x rows sit 256 bytes apart in shared memory and
// a row's 16-byte units at index u ^ (row & 1), so the 8 lanes of a load phase (rows g, g + 1)
// hit distinct banks; codes sit as [group][row][32 bytes], so a lane's 8-byte loads do too.
constexpr int kGemmRows = 256;  // output rows a block
constexpr int kGemmK = 128;     // inputs a stage

// The warp arrangement: RW row sets and TW n8 tiles a warp, 256 / (16 RW) x MT / TW warps.
// XP: x comes already in B's order (`gemm_permute_x`'s, made by the caller: each 16 inputs'
// 4 x 4 transposed) and is staged by cp.async with the codes, not through registers.
template <int MT, int RW, int TW, bool XP = false>
struct GemmWarps {
  static constexpr bool kXp = XP;
  static_assert(RW == 1 || RW == 2, "a warp takes one or two m16 row sets");
  static_assert(TW >= 1 && MT % TW == 0, "a warp takes a whole share of the n8 tiles");
  static constexpr int kRw = RW, kTw = TW;
  static constexpr int kRowWarps = kGemmRows / (16 * RW);
  static constexpr int kThreads = 32 * kRowWarps * (MT / TW);
  static_assert(kThreads <= 512, "at most 512 threads: each copies at least one row's group");
};

// The arrangement the op launches for MT n8 tiles: two row sets against all the tiles, so a
// weight's codes become bf16 once a block (bench/lab/gemm_arrangement.md, H100: the fastest
// of six at 64 rows on every layer shape, 3-9% under the earlier rw2/half; bitwise the same).
template <int MT>
using GemmChoice = GemmWarps<MT, 2, MT>;
constexpr int kGemmSmemBudget = 160 * 1024;  // fits sm_80's 163 KB a block as well as sm_90's

__host__ __device__ constexpr int gemm_stage_bytes(int mt) {
  return 2 * kGemmRows * 32 + kGemmRows * 8 + 8 * mt * kGemmK * 2;
}
__host__ __device__ constexpr int gemm_stages(int mt) {
  return kGemmSmemBudget / gemm_stage_bytes(mt) < 8 ? kGemmSmemBudget / gemm_stage_bytes(mt) : 8;
}

// 16 inputs of x (two uint4 of bf16 pairs (x0, x1), (x2, x3), ...) -> B's order (see above)
__device__ __forceinline__ void gemm_permute_x(const uint4 a, const uint4 b, uint4& lo,
                                               uint4& hi) {
  lo.x = __byte_perm(a.x, a.z, 0x5410);  // (x0, x4)
  lo.y = __byte_perm(b.x, b.z, 0x5410);  // (x8, x12)
  lo.z = __byte_perm(a.x, a.z, 0x7632);  // (x1, x5)
  lo.w = __byte_perm(b.x, b.z, 0x7632);  // (x9, x13)
  hi.x = __byte_perm(a.y, a.w, 0x5410);  // (x2, x6)
  hi.y = __byte_perm(b.y, b.w, 0x5410);  // (x10, x14)
  hi.z = __byte_perm(a.y, a.w, 0x7632);  // (x3, x7)
  hi.w = __byte_perm(b.y, b.w, 0x7632);  // (x11, x15)
}

// pair(w, e) (bf16 128 + code) minus 136: the exact bf16 (code - 8) of nibbles e and e + 4
__device__ __forceinline__ uint32_t gemm_pair(uint32_t w, int e) {
  const uint32_t p = pair(w, e);
  const __nv_bfloat162 v =
      __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&p), __float2bfloat162_rn(136.0f));
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int MT, int RW, int TW, bool XP>
__global__ void __launch_bounds__(GemmWarps<MT, RW, TW, XP>::kThreads, 1)
int4_gemm(const __nv_bfloat16* __restrict__ x, const Mats mt, const int32_t* __restrict__ index,
          float* __restrict__ y, int m, int n, int k) {
  extern __shared__ __align__(16) uint8_t gsm[];
  using Arr = GemmWarps<MT, RW, TW, XP>;
  constexpr int kT = Arr::kThreads, kMp = 8 * MT, kS = gemm_stages(MT);
  constexpr int kStage = gemm_stage_bytes(MT);
  constexpr int kXOff = 2 * kGemmRows * 32 + kGemmRows * 8;     // x's place in a stage
  constexpr int kXPieces = kMp * kGemmK / 16;                   // 32-byte pieces a stage
  constexpr int kXEach = (kXPieces + kT - 1) / kT;
  constexpr int kCopies = 2 * kGemmRows / kT;  // (row, group) pieces of codes a thread copies
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rw = static_cast<unsigned>(warp) % Arr::kRowWarps;
  const int j0 = static_cast<unsigned>(warp) / Arr::kRowWarps * TW;
  const int row0 = blockIdx.x * kGemmRows;
  const int steps = k / kGemmK, splits = gridDim.y, sp = blockIdx.y;
  const int s0 = static_cast<int>(static_cast<int64_t>(steps) * sp / splits);
  const int s1 = static_cast<int>(static_cast<int64_t>(steps) * (sp + 1) / splits);
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(gsm));

  // piece c of this thread: row (tid + c kT) / 2, group tid % 2 (rows past N copy the last
  // row; their sums are not stored)
  const uint8_t* wrow[kCopies];
  const float* srow[kCopies];
  const int cgrp = tid & 1;
  const int64_t layer = layer_of(mt, index);
#pragma unroll
  for (int c = 0; c < kCopies; ++c)
    row_ptrs(mt, min(row0 + ((tid + c * kT) >> 1), n - 1), layer, k, wrow[c], srow[c]);

  auto load_w = [&](int step, int slot) {
    const int k0 = step * kGemmK;
    const unsigned st = base + slot * kStage;
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int crow = (tid + c * kT) >> 1;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        cp_async16(st + cgrp * kGemmRows * 32 + crow * 32 + h * 16,
                   wrow[c] + k0 / 2 + 32 * cgrp + 16 * h);
      if (cgrp == 0)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(st + 2 * kGemmRows * 32 +
                                                                      crow * 8),
                     "l"(srow[c] + k0 / 64));
    }
  };
  // x piece i of a stage, already permuted (XP): two 16-byte copies into the swizzled row
  auto copy_x = [&](int step, int slot) {
#pragma unroll
    for (int j = 0; j < kXEach; ++j) {
      const int i = tid + j * kT;
      if (i < kXPieces) {
        const int r = i >> 3, u = 2 * (i & 7);
        const __nv_bfloat16* src = x + static_cast<int64_t>(r) * k + step * kGemmK + (i & 7) * 16;
        const unsigned row = base + slot * kStage + kXOff + r * kGemmK * 2;
        cp_async16(row + 16 * (u ^ (r & 1)), src);
        cp_async16(row + 16 * ((u + 1) ^ (r & 1)), src + 8);
      }
    }
  };
  // x piece i of a stage: row i / 8, lane block i % 8 (group (i % 8) / 4, t = i % 4)
  auto load_x = [&](int step, uint4 (&v)[kXEach][2]) {
#pragma unroll
    for (int j = 0; j < kXEach; ++j) {
      const int i = tid + j * kT;
      if (i < kXPieces) {
        const uint4* src = reinterpret_cast<const uint4*>(
            x + static_cast<int64_t>(i >> 3) * k + step * kGemmK + (i & 7) * 16);
        v[j][0] = __ldg(src);
        v[j][1] = __ldg(src + 1);
      }
    }
  };
  auto store_x = [&](int slot, const uint4 (&v)[kXEach][2]) {
#pragma unroll
    for (int j = 0; j < kXEach; ++j) {
      const int i = tid + j * kT;
      if (i < kXPieces) {
        const int r = i >> 3, u = 2 * (i & 7);
        uint4 lo, hi;
        gemm_permute_x(v[j][0], v[j][1], lo, hi);
        uint4* row = reinterpret_cast<uint4*>(gsm + slot * kStage + kXOff + r * kGemmK * 2);
        row[u ^ (r & 1)] = lo;
        row[(u + 1) ^ (r & 1)] = hi;
      }
    }
  };

  float acc[RW][TW][4];
#pragma unroll
  for (int a = 0; a < RW; ++a)
#pragma unroll
    for (int j = 0; j < TW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][j][e] = 0.0f;

  uint4 xv[XP ? 1 : kXEach][2];
#pragma unroll
  for (int i = 0; i < kS - 1; ++i) {
    if (s0 + i < s1) {
      load_w(s0 + i, i);
      if constexpr (XP) {
        copy_x(s0 + i, i);
      } else {
        load_x(s0 + i, xv);
        store_x(i, xv);
      }
    }
    cp_async_commit();
  }
  for (int step = s0; step < s1; ++step) {
    cp_async_wait<kS - 2>();
    __syncthreads();  // the stage has landed for every thread; the slot refilled below is free
    const int ahead = step + kS - 1, aslot = (ahead - s0) % kS;
    if (ahead < s1) {
      load_w(ahead, aslot);
      if constexpr (XP) copy_x(ahead, aslot);
      else load_x(ahead, xv);
    }
    cp_async_commit();
    const uint8_t* st = gsm + ((step - s0) % kS) * kStage;
    const float2* sc = reinterpret_cast<const float2*>(st + 2 * kGemmRows * 32);
    float2 s[RW][2];  // [row set][row g, g + 8]: the scales of groups 0 and 1
#pragma unroll
    for (int a = 0; a < RW; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) s[a][h] = sc[rw * 16 * RW + 16 * a + 8 * h + g];
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
      uint32_t af[RW][4][4];  // [row set][step q][a0..a3]
#pragma unroll
      for (int a = 0; a < RW; ++a) {
        const int r = rw * 16 * RW + 16 * a + g;
        const uint2 ca = *reinterpret_cast<const uint2*>(st + grp * kGemmRows * 32 + r * 32 +
                                                         8 * t);
        const uint2 cb = *reinterpret_cast<const uint2*>(st + grp * kGemmRows * 32 +
                                                         (r + 8) * 32 + 8 * t);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          af[a][q][0] = gemm_pair(ca.x, q);
          af[a][q][1] = gemm_pair(cb.x, q);
          af[a][q][2] = gemm_pair(ca.y, q);
          af[a][q][3] = gemm_pair(cb.y, q);
        }
      }
#pragma unroll
      for (int jj = 0; jj < TW; ++jj) {
        const int j = j0 + jj, r = 8 * j + g;
        const uint4* xr = reinterpret_cast<const uint4*>(st + kXOff + r * kGemmK * 2);
        const uint4 lo = xr[(grp * 8 + 2 * t) ^ (r & 1)];
        const uint4 hi = xr[(grp * 8 + 2 * t + 1) ^ (r & 1)];
#pragma unroll
        for (int a = 0; a < RW; ++a) {
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_bf16(d, af[a][0][0], af[a][0][1], af[a][0][2], af[a][0][3], lo.x, lo.y);
          mma_bf16(d, af[a][1][0], af[a][1][1], af[a][1][2], af[a][1][3], lo.z, lo.w);
          mma_bf16(d, af[a][2][0], af[a][2][1], af[a][2][2], af[a][2][3], hi.x, hi.y);
          mma_bf16(d, af[a][3][0], af[a][3][1], af[a][3][2], af[a][3][3], hi.z, hi.w);
          const float sg = grp ? s[a][0].y : s[a][0].x, sg8 = grp ? s[a][1].y : s[a][1].x;
          acc[a][jj][0] = fmaf(sg, d[0], acc[a][jj][0]);
          acc[a][jj][1] = fmaf(sg, d[1], acc[a][jj][1]);
          acc[a][jj][2] = fmaf(sg8, d[2], acc[a][jj][2]);
          acc[a][jj][3] = fmaf(sg8, d[3], acc[a][jj][3]);
        }
      }
    }
    if constexpr (!XP)
      if (ahead < s1) store_x(aslot, xv);  // its slot was freed by the barrier above
  }
  cp_async_wait<0>();

  // d0 / d1: row g, x rows 2t / 2t + 1; d2 / d3: row g + 8
  float* ys = y + static_cast<int64_t>(sp) * m * n;
#pragma unroll
  for (int a = 0; a < RW; ++a)
#pragma unroll
    for (int jj = 0; jj < TW; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + rw * 16 * RW + 16 * a + g + 8 * (e >> 1);
        const int col = 8 * (j0 + jj) + 2 * t + (e & 1);
        if (row < n && col < m) ys[static_cast<int64_t>(col) * n + row] = acc[a][jj][e];
      }
}

template <int MT, typename Arr = GemmChoice<MT>>
cudaError_t launch_gemm(cudaStream_t stream, const __nv_bfloat16* x, const Mats& mt,
                        const int32_t* index, float* y, int m, int k, int splits) {
  auto kernel = int4_gemm<MT, Arr::kRw, Arr::kTw, Arr::kXp>;
  constexpr int smem = gemm_stages(MT) * gemm_stage_bytes(MT);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int n = mt.start[mt.count];
  const dim3 grid((n + kGemmRows - 1) / kGemmRows, splits);
  kernel<<<grid, Arr::kThreads, smem, stream>>>(x, mt, index, y, m, n, k);
  return cudaGetLastError();
}

ffi::Error Int4GemmImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                        ffi::Buffer<ffi::S32> index, ffi::RemainingArgs rest,
                        ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Mats mt{};
  int64_t k = 0;
  if (const char* bad = decode_mats(rest, index, mt, k)) return ffi::Error::InvalidArgument(bad);
  const int64_t n = mt.start[mt.count];
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (k % kGemmK != 0) return ffi::Error::InvalidArgument("int4_gemm: K must be a multiple of 128");
  if (xd.size() != 2 || xd[1] != k || xd[0] % 16 != 0 || xd[0] < 16 || xd[0] > 64)
    return ffi::Error::InvalidArgument(
        "int4_gemm: x must be [Mp, K], Mp a multiple of 16 in 16..64");
  if (yd.size() != 3 || yd[1] < 1 || yd[1] > xd[0] || yd[2] != n || yd[0] < 1 ||
      yd[0] > k / kGemmK)
    return ffi::Error::InvalidArgument(
        "int4_gemm: y must be [splits <= K/128, M <= Mp, N] (fp32 partial sums)");
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.typed_data());
  const int mi = static_cast<int>(yd[1]), ki = static_cast<int>(k), sp = static_cast<int>(yd[0]);
  float* yp = y->typed_data();
  const int32_t* ip = index.typed_data();
  cudaError_t err;
  switch (xd[0] / 16) {
    case 1: err = launch_gemm<2>(stream, xp, mt, ip, yp, mi, ki, sp); break;
    case 2: err = launch_gemm<4>(stream, xp, mt, ip, yp, mi, ki, sp); break;
    case 3: err = launch_gemm<6>(stream, xp, mt, ip, yp, mi, ki, sp); break;
    default: err = launch_gemm<8>(stream, xp, mt, ip, yp, mi, ki, sp); break;
  }
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferInt4Gemv, Int4GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("rows_per_warp"),
                              {ffi::Traits::kCmdBufferCompatible});

namespace {
// The tensor-core GEMV calls' common operands: stream; x (bf16), corr (f32), index; the
// (codes, scales) pairs; y. Each call adds its attributes.
auto bf16_gemv_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferInt4GemvMma, Int4GemvMmaImpl,
                              bf16_gemv_binding()
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("prefetch"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferInt4GemvWide, Int4GemvWideImpl,
                              bf16_gemv_binding()
                                  .Attr<int64_t>("prefetch")
                                  .Attr<int64_t>("warps")
                                  .Attr<int64_t>("bias")
                                  .Attr<int64_t>("occupancy")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("xperm"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferInt4Mlp, Int4MlpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("warps")
                                  .Attr<int64_t>("occupancy")
                                  .Attr<int64_t>("launches"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferInt4Gemm, Int4GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
