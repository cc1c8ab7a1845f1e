// decode_stream_lab: can one persistent int4_g64 GEMV body stream the decode step's weights at
// >= 80% of the copy ceiling with no barrier, and what does a dependency between GEMVs cost
// once it does? (issue 44, step 1). Standalone CUDA, no JAX, no engine code.
//
// Build and run (on the GPU machine, with its own nvcc):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -Xptxas -v \
//        bench/lab/decode_stream_lab.cu -o decode_stream_lab
//   ./decode_stream_lab [--reps 15] [--stages 16] [--variants stream,barrier,barrier_pf,
//        flags,flags_pf,graph,pdl,feed,barrier_nx] [--no-shapes] [--seed N] [--json out.json]
//        [--copy-mb 2048] [--evict-first] [--packed] [--release-red] [--balanced] [--teams 1|2]
//        [--x-shared] [--y-half]
//
// What it measures, all in one process, as fractions of ceilings measured in the same run:
// - the copy ceiling: a 2 GiB device-to-device cudaMemcpy, (bytes read + bytes written) / time;
// - a read-only stream of the same weight bytes as each sequence (plain 16-byte loads);
// - the 27B C1 step's 257 int4 GEMVs (16 x [3 x (in_proj 16480x5120, out_proj 5120x6144,
//   gate|up 34816x5120, down 5120x17408), q|k|v 14336x5120, o_proj 5120x6144, gate|up, down],
//   lm_head 248320x5120: 14.41 GB of codes and scales), and each shape alone (every copy of it
//   in the chain, 0.66-6.4 GB, far past the 50 MB L2; lm_head: its one 715 MB copy), under:
//     stream      no dependency: every GEMV's x is a fixed input (the body's own rate);
//     barrier     x of GEMV s+1 is GEMV s's output; a grid barrier between GEMVs; the weight
//                 loads of GEMV s+1 are issued only after the barrier;
//     barrier_pf  the same barrier, the next GEMVs' weights streamed into the ring before it
//                 (issue 44's "mode 5");
//     flags       per-tile counters: a consumer tile's K-chunk c starts once every producer tile
//                 it needs has finished (no grid barrier); weight loads of chunk c wait too;
//     flags_pf    flags, weights streamed ahead of the dependency ("mode 5");
//     graph       one launch of the same kernel per GEMV, as a CUDA graph (the kernel-per-op
//                 form; the launch boundary is the dependency);
//     pdl         graph, each launch a programmatic dependent of the one before: it starts as
//                 soon as that one's CTAs have begun and left room (two CTAs fit an SM when
//                 --stages is small enough), streams its weights into the ring, and its
//                 consumers wait (griddepcontrol.wait) only before reading x: mode 5 across
//                 a launch boundary, the kernel-per-op form the engine could take op by op;
//     feed        diagnostic: stream, but consumers release every slot unread (the ring's
//                 feed alone, no arithmetic; its sums are wrong and its error is meaningless).
//     barrier_nx  diagnostic: barrier_pf, but after each barrier the consumers keep the x they
//                 staged once from the fixed input instead of restaging it from the previous
//                 GEMV's output (the wait without the restage; its error is meaningless).
//   --evict-first puts an L2 evict_first policy on the bulk copies; --packed stores the
//   weights a stage at a time (packed_code), so a stage is one bulk copy instead of 32;
//   --release-red publishes flags with one red.release.gpu a chunk instead of a __threadfence
//   and atomicAdds after each tile; --balanced splits each GEMV's stages evenly over the CTAs
//   (stream-K: a tile cut between two CTAs leaves two partial row sums, added in a fixed order
//   by whoever reads them); --teams 2 runs 16 consumer warps as two teams taking alternate
//   ring slots. --x-shared (with --teams 2): the two warps of the teams that own the same
//   groups keep one copy of x and stage half of it each, synchronized by a named barrier of
//   the pair (the restage reads x once a CTA instead of once a team); --y-half: a GEMV's
//   epilogue also writes its output clamped and rounded to f16, and the next GEMV's restage
//   reads that (8 bytes a 4 inputs instead of 16; the same f16 x bit for bit, so the same sums).
//   Both are template parameters of the body, so the default body compiles as before.
//   --mid (graph and pdl): a small kernel between each two GEMVs, as the step's norms are (one
//   CTA: x of the next GEMV = y * rsqrt(mean(y^2))), a plain launch under graph and a
//   programmatic dependent under pdl: what a foreign op between two GEMVs costs the chain.
//   --fold (graph and pdl): the same norm folded into the GEMVs instead: each tile's epilogue
//   writes its rows' sum of squares, and the next GEMV's restage adds those (a fixed order)
//   and scales x as it stages it.
//
// The body. One CTA an SM (persistent, cooperative launch), 8 consumer warps and one producer
// thread. The producer walks the CTA's work in order and feeds a ring of shared-memory slots
// with cp.async.bulk (1D bulk copies completing on an mbarrier); a slot is one stage, 16 rows x
// 1024 inputs of one GEMV: 16 copies of 512 code bytes (one a row, into rows padded to 544 B so
// the consumers' reads hit distinct banks) and 16 copies of 64 scale bytes. Weights do not
// depend on x, so the ring runs across GEMV boundaries whenever the variant lets it. A GEMV's
// rows are cut into 16-row tiles handed out round robin over the whole launch (tile T of the
// launch goes to CTA T mod grid), every tile covering all of K. Each consumer warp owns 2 of a
// stage's 16 groups of 64 inputs: it dequantizes two codes at a time into f16x2 (LOP3 mask +
// 0x6400 magic; one HADD2/HFMA2 folds the -8 exactly) and multiplies them on the tensor cores
// (mma.sync m16n8k16, f16 in, f32 accumulate; A = 16 rows' codes, B = x in f16, every column
// the same), one fresh accumulator a group, scaled into an f32 row sum per group. x is staged
// per warp (each warp only ever reads its own groups of x) as f16 pairs in the codes' nibble
// order. At a tile's end the 8 warps' row sums meet in shared memory and warp 0 adds them in a
// fixed order: no float atomics, results bitwise reproducible.
//
// Dependencies: x of GEMV s+1 is y_s[k mod N_s] clamped to [-4, 4]. Its chunk c (1024 inputs)
// waits for every tile of GEMV s whose rows r fold onto it, (r mod K) / 1024 == c when N >= K
// (all of y_s, as the real step's GDN and SwiGLU need), the rows it reads when N < K. Counters
// are monotonic over launches (compared with epoch x expected), never reset between launches.
//
// Correctness: outputs poisoned (NaN) before a checked launch; sampled GEMVs compared with an
// f64 reference computed from the same f32 x (so the f16 rounding of x counts in the error);
// the whole sequence's outputs of two launches compared bitwise (determinism).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "../lab_common.cuh"

namespace lab {

constexpr int kRows = 16;                                    // a tile
constexpr int kChunk = 1024;                                 // inputs a stage
constexpr int kCW = 8;                                       // consumer warps
constexpr int kCodeRow = kChunk / 2;                         // 512 B of a row a stage
constexpr int kCodeStride = kCodeRow + 32;                   // padded: rows 32 B apart mod 128
constexpr int kScaleRow = kChunk / 64 * 4;                   // 64 B
constexpr int kScaleStride = 80;                             // padded likewise
constexpr int kSlotCodes = kRows * kCodeStride;              // 8704
constexpr int kSlotBytes = kSlotCodes + kRows * kScaleStride;  // 9984
constexpr int kStageTx = kRows * (kCodeRow + kScaleRow);     // 9216 bytes a stage
constexpr int kMaxK = 17408;
constexpr int kMaxChunks = kMaxK / kChunk;                   // 17
constexpr int kXsWarp = kMaxChunks * 2 * 128;                // a warp's x: 2 groups a chunk
constexpr int kCntStride = 32;                               // counters an item
constexpr int kSumBatch = 17;  // --fold: tile sums a lane loads at once (2,176 = 4 x 32 x 17)

struct Gemv {
  const uint8_t* w;  // [n, k/2]
  const float* s;    // [n, k/64]
  float* y;          // [n]
  float* y1;         // [n] (--balanced): the second partial sum of a tile cut between CTAs
  __half* y16;       // [n] (--y-half): clamp(y) in f16, what the next GEMV's x is made of
  int n, k;
};

struct Item {
  int gemv;   // index into the GEMV table
  int prev;   // GEMV whose output is x; -1: the fixed input
  int tbase;  // the launch's tile number of this item's tile 0, mod the grid
  int pad;
};

enum Mode { kStream = 0, kBarrier = 1, kFlags = 2, kNoWait = 3 };

struct Params {
  const Gemv* gemvs;
  const Item* items;
  int count;
  int mode;
  int prefetch;  // the producer streams weights ahead of dependencies
  unsigned epoch;
  unsigned* bar;           // [count]: CTAs done with item s
  unsigned* cnt;           // [count * kCntStride]: tiles done feeding chunk c of item s's x
  const unsigned* expect;  // the same shape: tiles a chunk needs
  const float* xin;        // [kMaxK]
  int stages;
  int nomath;  // consumers release each slot unread (the ring's feed alone; wrong sums)
  int hint;    // bulk copies carry an L2 evict_first policy
  int packed;  // weights stored a stage at a time: one 9216-byte bulk copy a stage (--packed)
  int relred;  // flags published by red.release.gpu instead of __threadfence + atomicAdd
  int balanced;  // stream-K split of each GEMV's stages over the CTAs (--balanced)
  int norestage;  // barrier_nx: x staged once (all kMaxK inputs), never after a barrier
  int pdl;  // pdl: launched as the previous launch's programmatic dependent; x waits for it
  int mid;  // --mid: x is the previous GEMV's y normalized by the mid kernel (into its y1)
  int fold;  // --fold: the norm folded in: tile sums of squares into y1, the scale in the restage
};

// --packed: a GEMV's codes and scales stored as the stages the ring takes, stage (t, c) of
// tile t and chunk c at ((t * C + c) * kStageTx): 16 rows of 512 code bytes, the 32-byte
// units of row r at unit u ^ (r & 3), then 16 rows of 64 scale bytes, the 8-byte units of
// row r at v ^ ((r >> 1) & 3). The XORs put the consumers' reads of 8 rows on distinct banks
// (what the padding does in the default layout), so one bulk copy moves a stage.
__host__ __device__ __forceinline__ int64_t packed_code(int row, int kb, int k) {
  const int t = row / kRows, r = row % kRows, c = kb / kCodeRow, u = (kb % kCodeRow) / 32;
  return (static_cast<int64_t>(t) * (k / kChunk) + c) * kStageTx + r * kCodeRow +
         ((u ^ (r & 3)) * 32) + kb % 32;
}
__host__ __device__ __forceinline__ int64_t packed_scale(int row, int gi, int k) {
  const int t = row / kRows, r = row % kRows, c = gi / 16, v = (gi % 16) / 2;
  return (static_cast<int64_t>(t) * (k / kChunk) + c) * kStageTx + kRows * kCodeRow +
         r * kScaleRow + ((v ^ ((r >> 1) & 3)) * 8) + (gi % 2) * 4;
}

// Does the tile starting at row r0 of a GEMV with n rows feed chunk c of the next GEMV's x (k
// inputs, x[j] = y[j mod n])?
__host__ __device__ __forceinline__ bool feeds(int r0, int n, int k, int c) {
  if (n >= k) return (r0 % k) / kChunk == c;
  return ((c * kChunk) % n) / kChunk == r0 / kChunk;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count));
}

__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
        " selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_u32(b)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)),
               "r"(tx)
               : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_copy_hint(void* dst, const void* src, uint32_t bytes,
                                               uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1], %2, [%3], %4;" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One release-ordered add at GPU scope: the writes this thread has seen (the tile's y, ordered by
// the __syncwarp before it) are visible to whoever acquires the counter, without a full fence.
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void spin_geq(const unsigned* p, unsigned target) {
  while (static_cast<int>(ld_acquire(p) - target) < 0) {
  }
}

__device__ __forceinline__ uint32_t lop3_mask_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}

__device__ __forceinline__ uint32_t hadd2_u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t hfma2_u(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// The 8 codes of word w (byte j: input 2j low nibble, 2j+1 high) as four f16 pairs of (c - 8):
// p[0] = (k0, k4), p[1] = (k1, k5), p[2] = (k2, k6), p[3] = (k3, k7). Exact.
__device__ __forceinline__ void dequant(uint32_t w, uint32_t p[4]) {
  const uint32_t m1032 = 0xE408E408u;  // -1032
  const uint32_t s16 = 0x2C002C00u;    // 1/16
  const uint32_t m72 = 0xD480D480u;    // -72
  const uint32_t w8 = w >> 8;
  p[0] = hadd2_u(lop3_mask_or(w, 0x000F000Fu, 0x64006400u), m1032);   // (1024 + c) - 1032
  p[1] = hfma2_u(lop3_mask_or(w, 0x00F000F0u, 0x64006400u), s16, m72);  // (1024+16c)/16 - 72
  p[2] = hadd2_u(lop3_mask_or(w8, 0x000F000Fu, 0x64006400u), m1032);
  p[3] = hfma2_u(lop3_mask_or(w8, 0x00F000F0u, 0x64006400u), s16, m72);
}

__device__ __forceinline__ void mma16816(float d[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ float clamp4(float v) { return fminf(fmaxf(v, -4.0f), 4.0f); }

// Chunk c of x into the warp's area, its groups 2w and 2w + 1, by 16 lanes (l = 0..15): group
// gi = l / 8, lane-quad tt = (l % 8) / 2, word i = l % 2; 8 inputs from k = 64 G + 16 tt + 8 i,
// stored as (x0, x4), (x1, x5), (x2, x6), (x3, x7) at [c * 2 + gi][tt][i].
// With src1 (--balanced) the input is src + src1, the two partial sums of a cut tile; `scale`
// (--fold: the RMS norm's scale applied as x is staged; 1 otherwise, which changes no bit).
__device__ __forceinline__ void stage_chunk(uint4* xs, const float* src, const float* src1,
                                            int xn, int c, int w, int l, float scale = 1.0f) {
  const int gi = l >> 3, tt = (l & 7) >> 1, i = l & 1;
  const int G = c * 16 + 2 * w + gi;
  const int k = (64 * G + 16 * tt + 8 * i) % xn;  // xn is a multiple of 8
  float4 a = __ldcg(reinterpret_cast<const float4*>(src + k));
  float4 b = __ldcg(reinterpret_cast<const float4*>(src + k + 4));
  if (src1) {
    const float4 a1 = __ldcg(reinterpret_cast<const float4*>(src1 + k));
    const float4 b1 = __ldcg(reinterpret_cast<const float4*>(src1 + k + 4));
    a = make_float4(a.x + a1.x, a.y + a1.y, a.z + a1.z, a.w + a1.w);
    b = make_float4(b.x + b1.x, b.y + b1.y, b.z + b1.z, b.w + b1.w);
  }
  uint4 o;
  o.x = pack_h2(clamp4(a.x * scale), clamp4(b.x * scale));
  o.y = pack_h2(clamp4(a.y * scale), clamp4(b.y * scale));
  o.z = pack_h2(clamp4(a.z * scale), clamp4(b.z * scale));
  o.w = pack_h2(clamp4(a.w * scale), clamp4(b.w * scale));
  xs[(c * 2 + gi) * 8 + tt * 2 + i] = o;
}

// stage_chunk from y16 (--y-half): the 8 inputs are one 16-byte load of f16 already clamped and
// rounded; byte permutes put them in the stage's (x0, x4), (x1, x5), ... order.
__device__ __forceinline__ void stage_chunk16(uint4* xs, const __half* src, int xn, int c, int w,
                                              int l) {
  const int gi = l >> 3, tt = (l & 7) >> 1, i = l & 1;
  const int k = (64 * (c * 16 + 2 * w + gi) + 16 * tt + 8 * i) % xn;
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(src + k));
  uint4 o;
  o.x = __byte_perm(v.x, v.z, 0x5410);
  o.y = __byte_perm(v.x, v.z, 0x7632);
  o.z = __byte_perm(v.y, v.w, 0x5410);
  o.w = __byte_perm(v.y, v.w, 0x7632);
  xs[(c * 2 + gi) * 8 + tt * 2 + i] = o;
}

// The named barrier of the pair of warps (one a team) that own groups 2 gw, 2 gw + 1
// (--x-shared); ids 2..9 (0: __syncthreads, 1: the consumers' row-sum barrier).
__device__ __forceinline__ void pair_sync(int gw) {
  asm volatile("bar.sync %0, 64;" ::"r"(2 + gw) : "memory");
}

// A CTA's share of item s, as segments (tile t, chunks [c0, c1)): round robin, whole tiles
// t0, t0 + G, ... (t0 from the launch-wide tile count); --balanced, the stages [lo, hi) of the
// item's nt x C, lo = nt C b / G (a stream-K split: every CTA gets the same number of stages,
// within one, and a tile cut between two CTAs leaves two partial row sums, y and y1).
struct Walk {
  int64_t i, hi;
  int t, nt, C, G;
  bool bal;
  __device__ Walk(const Item& it, const Gemv& gv, int b, int G_, bool bal_)
      : t(0), nt(gv.n / kRows), C(gv.k / kChunk), G(G_), bal(bal_) {
    const int64_t total = static_cast<int64_t>(nt) * C;
    i = bal ? total * b / G : 0;
    hi = bal ? total * (b + 1) / G : 0;
    if (!bal) t = (b - it.tbase + G) % G;
  }
  __device__ bool empty() const { return bal ? i >= hi : t >= nt; }
  __device__ bool next(int& tt, int& c0, int& c1) {
    if (bal) {
      if (i >= hi) return false;
      tt = static_cast<int>(i / C);
      c0 = static_cast<int>(i % C);
      c1 = static_cast<int>(c0 + hi - i < C ? c0 + hi - i : C);
      i += c1 - c0;
      return true;
    }
    if (t >= nt) return false;
    tt = t;
    c0 = 0;
    c1 = C;
    t += G;
    return true;
  }
};

// TEAMS consumer teams of kCW warps: with 2, team j takes the ring's slots of parity j (the
// stages alternate between the teams), so 4 warps a scheduler hide each other's latency.
// XS: bit 0 --x-shared (with two teams), bit 1 --y-half.
template <int TEAMS, int XS>
__global__ void __launch_bounds__((kCW * TEAMS + 1) * 32, 1) stream_gemv(const Params p) {
  constexpr int CW = kCW * TEAMS;
  constexpr bool kShared = (XS & 1) && TEAMS > 1, kHalf = (XS & 2) != 0;
  extern __shared__ __align__(128) uint8_t smem[];
  const int S = p.stages;
  uint8_t* const ring = smem;
  uint8_t* const xs_base = smem + S * kSlotBytes;
  float* const red = reinterpret_cast<float*>(xs_base + CW * kXsWarp);
  uint64_t* const full =
      reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(red) + 2 * CW * kRows * 4);
  uint64_t* const empty = full + S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  const bool bal = p.balanced;
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, kCW);  // one team reads a slot
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // pdl: the next launch may start now (its CTAs land where this one leaves room, stream their
  // weights and wait before reading x)
  if (p.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  if (warp == CW) {  // the producer: one thread
    if (lane != 0) return;
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    int slot = 0;
    uint32_t ph = 0;
    for (int s = 0; s < p.count; ++s) {
      const Item it = p.items[s];
      const Gemv gv = p.gemvs[it.gemv];
      Walk wk(it, gv, b, G, bal);
      if (wk.empty()) continue;
      const bool dep = !p.prefetch && (p.mode == kBarrier || p.mode == kFlags) && s > 0 &&
                       it.prev >= 0;
      if (dep && p.mode == kBarrier) spin_geq(p.bar + s - 1, p.epoch * G);
      unsigned ready = (dep && p.mode == kFlags) ? 0u : ~0u;
      const int64_t rowb = gv.k / 2, rows = gv.k / 64;
      const int C = gv.k / kChunk;
      int t, c0, c1;
      while (wk.next(t, c0, c1)) {
        const uint8_t* wsrc = gv.w + static_cast<int64_t>(t) * kRows * rowb;
        const float* ssrc = gv.s + static_cast<int64_t>(t) * kRows * rows;
        for (int c = c0; c < c1; ++c) {
          if (!((ready >> c) & 1u)) {
            spin_geq(p.cnt + s * kCntStride + c, p.epoch * p.expect[s * kCntStride + c]);
            ready |= 1u << c;
          }
          mbar_wait(empty + slot, ph ^ 1u);
          mbar_expect(full + slot, kStageTx);
          uint8_t* dst = ring + slot * kSlotBytes;
          if (p.packed) {
            const uint8_t* src = gv.w + (static_cast<int64_t>(t) * C + c) * kStageTx;
            if (p.hint)
              bulk_copy_hint(dst, src, kStageTx, full + slot, policy);
            else
              bulk_copy(dst, src, kStageTx, full + slot);
          } else if (p.hint) {
#pragma unroll
            for (int r = 0; r < kRows; ++r)
              bulk_copy_hint(dst + r * kCodeStride, wsrc + r * rowb + c * kCodeRow, kCodeRow,
                             full + slot, policy);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
              bulk_copy_hint(dst + kSlotCodes + r * kScaleStride, ssrc + r * rows + c * 16,
                             kScaleRow, full + slot, policy);
          } else {
#pragma unroll
            for (int r = 0; r < kRows; ++r)
              bulk_copy(dst + r * kCodeStride, wsrc + r * rowb + c * kCodeRow, kCodeRow,
                        full + slot);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
              bulk_copy(dst + kSlotCodes + r * kScaleStride, ssrc + r * rows + c * 16,
                        kScaleRow, full + slot);
          }
          if (++slot == S) {
            slot = 0;
            ph ^= 1u;
          }
        }
      }
    }
    return;
  }

  // The consumers: warp w of a team (gw) owns groups 2 gw and 2 gw + 1 of its stages.
  const int team = warp / kCW, gw = warp % kCW;
  const int g = lane >> 2, tq = lane & 3;
  uint4* const xs = reinterpret_cast<uint4*>(xs_base + (kShared ? gw : warp) * kXsWarp);
  // x's chunks [0, C) into xs: a warp's two halves take alternate chunks; with kShared the
  // pair's two warps take alternate pairs of them, after both have read the x before
  auto restage = [&](const float* src, const float* src1, const __half* src16, int xn, int C,
                     float scale) {
    if (kShared) pair_sync(gw);
    for (int c = (kShared ? 2 * team : 0) + (lane >> 4); c < C; c += kShared ? 4 : 2) {
      if (kHalf && src16)
        stage_chunk16(xs, src16, xn, c, gw, lane & 15);
      else
        stage_chunk(xs, src, src1, xn, c, gw, lane & 15, scale);
    }
    if (kShared)
      pair_sync(gw);
    else
      __syncwarp();
  };
  int slot = 0, par = 0;
  uint32_t ph = 0;
  // barrier_nx: every chunk any GEMV reads, once, from the fixed input
  if (p.norestage) restage(p.xin, nullptr, nullptr, kMaxK, kMaxChunks, 1.0f);
  for (int s = 0; s < p.count; ++s) {
    const Item it = p.items[s];
    const Gemv gv = p.gemvs[it.gemv];
    const int C = gv.k / kChunk;
    Walk wk(it, gv, b, G, bal);
    const bool has_prev = s > 0 && it.prev >= 0;
    const bool dep = (p.mode == kBarrier || p.mode == kFlags) && has_prev;
    const float* xsrc = p.xin;
    const float* xsrc1 = nullptr;
    const __half* xsrc16 = nullptr;
    int xn = kMaxK;
    if (p.mode != kStream && it.prev >= 0) {
      xsrc = p.mid ? p.gemvs[it.prev].y1 : p.gemvs[it.prev].y;
      if (kHalf) xsrc16 = p.gemvs[it.prev].y16;
      if (bal) xsrc1 = p.gemvs[it.prev].y1;
      xn = p.gemvs[it.prev].n;
    }
    unsigned ready = 0;
    if (!wk.empty()) {
      if (!(dep && p.mode == kFlags)) {
        if (dep) {  // the grid barrier
          if (lane == 0) spin_geq(p.bar + s - 1, p.epoch * G);
          __syncwarp();
        }
        // pdl: the previous launch (whose output is x) complete and its writes visible
        if (p.pdl && it.prev >= 0) asm volatile("griddepcontrol.wait;" ::: "memory");
        float xscale = 1.0f;
        if (p.fold && it.prev >= 0) {  // the norm: the previous GEMV's tile sums of squares
          const float* part = p.gemvs[it.prev].y1;  // added in a fixed order by every warp
          float ss = 0.0f;
          // kSumBatch loads a lane in flight before their adds (the order of the adds is the
          // plain loop's: lane, lane + 32, ...): run 7 read them one at a time, a chain of up
          // to 68 L2 latencies
          const int nt = xn / kRows;
          for (int i0 = lane; i0 < nt; i0 += 32 * kSumBatch) {
            float v[kSumBatch];
#pragma unroll
            for (int u = 0; u < kSumBatch; ++u)
              v[u] = i0 + 32 * u < nt ? __ldcg(part + i0 + 32 * u) : 0.0f;
#pragma unroll
            for (int u = 0; u < kSumBatch; ++u) ss += v[u];
          }
          for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
          xscale = rsqrtf(ss / xn + 1e-6f);
        }
        if (!p.norestage) restage(xsrc, xsrc1, xsrc16, xn, C, xscale);
        ready = ~0u;
      }
      // the next item's K (for the counters a tile feeds)
      const int knext = s + 1 < p.count ? p.gemvs[p.items[s + 1].gemv].k : 0;
      int t, c0, c1;
      while (wk.next(t, c0, c1)) {
        float acc0 = 0.0f, acc1 = 0.0f;
        for (int c = c0; c < c1; ++c) {
          if (TEAMS > 1 && (slot & 1) != team) {  // the other team's stage
            if (++slot == S) {
              slot = 0;
              ph ^= 1u;
            }
            continue;
          }
          if (!((ready >> c) & 1u)) {
            if (lane == 0)
              spin_geq(p.cnt + s * kCntStride + c, p.epoch * p.expect[s * kCntStride + c]);
            __syncwarp();
            if (lane < 16) {  // flags: never kShared (the host refuses it)
              if (kHalf && xsrc16)
                stage_chunk16(xs, xsrc16, xn, c, gw, lane);
              else
                stage_chunk(xs, xsrc, xsrc1, xn, c, gw, lane);
            }
            __syncwarp();
            ready |= 1u << c;
          }
          mbar_wait(full + slot, ph);
          if (p.nomath) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + slot);
            if (++slot == S) {
              slot = 0;
              ph ^= 1u;
            }
            continue;
          }
          const uint8_t* sl = ring + slot * kSlotBytes;
          uint2 wg0, wg1, wh0, wh1;
          float2 sg, sh;
          if (p.packed) {  // rows 512 B apart, units swizzled (packed_code, packed_scale)
            const uint8_t* cr = sl + g * kCodeRow + tq * 8;
            const int u0 = ((2 * gw) ^ (g & 3)) * 32, u1 = ((2 * gw + 1) ^ (g & 3)) * 32;
            wg0 = *reinterpret_cast<const uint2*>(cr + u0);
            wg1 = *reinterpret_cast<const uint2*>(cr + u1);
            wh0 = *reinterpret_cast<const uint2*>(cr + 8 * kCodeRow + u0);
            wh1 = *reinterpret_cast<const uint2*>(cr + 8 * kCodeRow + u1);
            const uint8_t* sr = sl + kRows * kCodeRow + ((gw ^ ((g >> 1) & 3)) * 8);
            sg = *reinterpret_cast<const float2*>(sr + g * kScaleRow);
            sh = *reinterpret_cast<const float2*>(sr + (g + 8) * kScaleRow);
          } else {
            const uint8_t* cg = sl + g * kCodeStride + gw * 64 + tq * 8;
            wg0 = *reinterpret_cast<const uint2*>(cg);
            wg1 = *reinterpret_cast<const uint2*>(cg + 32);
            wh0 = *reinterpret_cast<const uint2*>(cg + 8 * kCodeStride);
            wh1 = *reinterpret_cast<const uint2*>(cg + 8 * kCodeStride + 32);
            sg = *reinterpret_cast<const float2*>(sl + kSlotCodes + g * kScaleStride + gw * 8);
            sh = *reinterpret_cast<const float2*>(sl + kSlotCodes + (g + 8) * kScaleStride +
                                                  gw * 8);
          }
          const uint4* xq = xs + c * 16 + tq * 2;
          const uint4 x00 = xq[0], x01 = xq[1], x10 = xq[8], x11 = xq[9];
          __syncwarp();
          if (lane == 0) mbar_arrive(empty + slot);
          if (++slot == S) {
            slot = 0;
            ph ^= 1u;
          }
          // group 2 gw
          {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            uint32_t pa[4], pb[4];
            dequant(wg0.x, pa);
            dequant(wh0.x, pb);
            mma16816(d, pa[0], pb[0], pa[1], pb[1], x00.x, x00.y);
            mma16816(d, pa[2], pb[2], pa[3], pb[3], x00.z, x00.w);
            dequant(wg0.y, pa);
            dequant(wh0.y, pb);
            mma16816(d, pa[0], pb[0], pa[1], pb[1], x01.x, x01.y);
            mma16816(d, pa[2], pb[2], pa[3], pb[3], x01.z, x01.w);
            acc0 = fmaf(sg.x, d[0], acc0);
            acc1 = fmaf(sh.x, d[2], acc1);
          }
          // group 2 gw + 1
          {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            uint32_t pa[4], pb[4];
            dequant(wg1.x, pa);
            dequant(wh1.x, pb);
            mma16816(d, pa[0], pb[0], pa[1], pb[1], x10.x, x10.y);
            mma16816(d, pa[2], pb[2], pa[3], pb[3], x10.z, x10.w);
            dequant(wg1.y, pa);
            dequant(wh1.y, pb);
            mma16816(d, pa[0], pb[0], pa[1], pb[1], x11.x, x11.y);
            mma16816(d, pa[2], pb[2], pa[3], pb[3], x11.z, x11.w);
            acc0 = fmaf(sg.y, d[0], acc0);
            acc1 = fmaf(sh.y, d[2], acc1);
          }
        }
        // The segment's rows: the CW warps' sums added by warp 0 in a fixed order; a segment
        // that starts a tile writes y, one that ends a cut tile writes y1 (--balanced).
        float* rb = red + par * CW * kRows;
        if (tq == 0) {
          rb[warp * kRows + g] = acc0;
          rb[warp * kRows + g + 8] = acc1;
        }
        asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
        if (warp == 0) {
          float sq = 0.0f;
          if (lane < kRows) {
            float sum = rb[lane];
#pragma unroll
            for (int w2 = 1; w2 < CW; ++w2) sum += rb[w2 * kRows + lane];
            sq = sum * sum;
            const int row = t * kRows + lane;
            if (c0 == 0) {
              gv.y[row] = sum;
              if (kHalf) gv.y16[row] = __float2half_rn(clamp4(sum));
              if (bal && c1 == C) gv.y1[row] = 0.0f;
            } else {
              gv.y1[row] = sum;
            }
          }
          if (p.fold) {  // the tile's sum of squares, lanes 0-15 in a fixed tree, into y1[t]
            for (int o = 8; o; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
            if (lane == 0) gv.y1[t] = sq;
          }
          if (p.mode == kFlags && s + 1 < p.count) {
            __syncwarp();
            if (lane == 0) {
              if (!p.relred) __threadfence();
              for (int c2 = 0; c2 < knext / kChunk; ++c2)
                if (feeds(t * kRows, gv.n, knext, c2)) {
                  if (p.relred)
                    red_release_add(p.cnt + (s + 1) * kCntStride + c2, 1u);
                  else
                    atomicAdd(p.cnt + (s + 1) * kCntStride + c2, 1u);
                }
            }
          }
        }
        par ^= 1;
      }
    }
    if (p.mode == kBarrier && s + 1 < p.count && warp == 0) {
      __syncwarp();
      if (lane == 0) {
        __threadfence();
        atomicAdd(p.bar + s, 1u);
      }
    }
  }
}

// ---- reference, data, ceilings ----

// f64 reference of one GEMV from x[k] = clamp(src[k mod xn] (+ src1[k mod xn])) (f32, not
// rounded to f16): a warp
// a row.
// --mid: a small op between two GEMVs, as the step's RMSNorms are: one CTA reads y [n] from L2,
// and writes y * rsqrt(mean(y^2) + 1e-6) into out (the next GEMV's x). With pdl it triggers its
// dependent at its start and waits for the GEMV before it; otherwise it is a plain launch.
__global__ void __launch_bounds__(1024) mid_norm(const float* y, float* out, int n, int pdl) {
  __shared__ float part[32];
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  float ss = 0.0f;
  for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(y + i));
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    ss = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.0f;
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x == 0) part[0] = rsqrtf(ss / n + 1e-6f);
  }
  __syncthreads();
  const float r = part[0];
  for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(y + i));
    __stcg(reinterpret_cast<float4*>(out + i), make_float4(v.x * r, v.y * r, v.z * r, v.w * r));
  }
}

__global__ void reference(Gemv g, const float* src, const float* src1, int xn, double* out,
                          int packed) {
  const int row = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= g.n) return;
  double acc = 0.0;
  for (int gi = lane; gi < g.k / 64; gi += 32) {
    const uint8_t* cb = g.w + static_cast<int64_t>(row) * (g.k / 2) + gi * 32;
    double part = 0.0;
    for (int bb = 0; bb < 32; ++bb) {
      const int byte = packed ? g.w[packed_code(row, gi * 32 + bb, g.k)] : cb[bb];
      const int k = 64 * gi + 2 * bb;
      const float x0 = src1 ? src[k % xn] + src1[k % xn] : src[k % xn];
      const float x1 = src1 ? src[(k + 1) % xn] + src1[(k + 1) % xn] : src[(k + 1) % xn];
      part += static_cast<double>((byte & 15) - 8) * clamp4(x0);
      part += static_cast<double>((byte >> 4) - 8) * clamp4(x1);
    }
    acc += part * (packed ? *reinterpret_cast<const float*>(g.w + packed_scale(row, gi, g.k))
                          : g.s[static_cast<int64_t>(row) * (g.k / 64) + gi]);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[row] = acc;
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
    const uint64_t v = seed * 0x9E3779B97F4A7C15ull + 4 * i;
    p[i] = make_uint4(mix(v), mix(v + 1), mix(v + 2), mix(v + 3));
  }
}

// Scale i of a GEMV with k inputs: near 1 / (sd(code) sqrt(K)), so x keeps its size along
// the chain.
__device__ __forceinline__ float scale_value(int64_t i, int k, uint64_t seed) {
  const float base = 1.0f / (4.61f * sqrtf(static_cast<float>(k)));
  return base * (0.5f + (mix(seed * 0x2545F4914F6CDD1Dull + i) >> 8) * (1.0f / 16777216.0f));
}

__global__ void fill_scales(float* p, int64_t n, int k, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = scale_value(i, k, seed);
}

// --packed: the same scale values as fill_scales, written where packed_scale puts them (the
// codes' fill covers the whole stage layout first, scale slots included).
__global__ void fill_scales_packed(uint8_t* w, int n, int k, uint64_t seed) {
  const int64_t total = static_cast<int64_t>(n) * (k / 64);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / (k / 64)), gi = static_cast<int>(i % (k / 64));
    *reinterpret_cast<float*>(w + packed_scale(row, gi, k)) = scale_value(i, k, seed);
  }
}

__global__ void fill_x(float* p, int n, uint64_t seed) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = ((mix(seed * 31 + i) >> 8) * (1.0f / 16777216.0f) - 0.5f) * 3.0f;
}

struct Blk {
  const uint4* p;
  int64_t n16;
};

__global__ void __launch_bounds__(256) read_blocks(const Blk* blks, int nb, unsigned* sink) {
  uint32_t a = 0;
  for (int bi = blockIdx.x; bi < nb; bi += gridDim.x) {
    const Blk k = blks[bi];
    for (int64_t i = threadIdx.x; i < k.n16; i += 4 * blockDim.x) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t j = i + u * blockDim.x;
        if (j < k.n16)
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                       : "l"(k.p + j));
        else
          v[u] = make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) a ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (a == 0x12345678u) *sink = a;  // never, but the loads stay
}

struct Layer {
  int n, k;
  const char* name;
};

}  // namespace lab

using namespace lab;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A launch as a programmatic dependent of the launch before it in the stream (pdl): it may start
// once that one's CTAs have all triggered (griddepcontrol.launch_dependents) or exited.
template <typename... K, typename... A>
cudaError_t launch_dependent(cudaStream_t st, int grid, int threads, size_t smem,
                             void (*kern)(K...), A... args) {
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cf = {};
  cf.gridDim = dim3(grid);
  cf.blockDim = dim3(threads);
  cf.dynamicSmemBytes = smem;
  cf.stream = st;
  cf.attrs = at;
  cf.numAttrs = 1;
  return cudaLaunchKernelEx(&cf, kern, args...);
}

int main(int argc, char** argv) {
  int reps = 15, stages = 16, copy_mb = 2048, hint = 0, packed = 0, relred = 0, balanced = 0,
      teams = 1, xshared = 0, yhalf = 0, mid = 0, fold = 0;
  bool shapes = true;
  uint64_t seed = static_cast<uint64_t>(time(nullptr));
  std::string variants = "stream,barrier,barrier_pf,flags,flags_pf,graph", json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) {
        fprintf(stderr, "%s needs a value\n", a.c_str());
        exit(2);
      }
      return argv[++i];
    };
    if (a == "--reps") reps = atoi(val());
    else if (a == "--stages") stages = atoi(val());
    else if (a == "--variants") variants = val();
    else if (a == "--no-shapes") shapes = false;
    else if (a == "--seed") seed = strtoull(val(), nullptr, 10);
    else if (a == "--json") json_path = val();
    else if (a == "--copy-mb") copy_mb = atoi(val());
    else if (a == "--evict-first") hint = 1;
    else if (a == "--packed") packed = 1;
    else if (a == "--release-red") relred = 1;
    else if (a == "--balanced") balanced = 1;
    else if (a == "--teams") teams = atoi(val());
    else if (a == "--x-shared") xshared = 1;
    else if (a == "--y-half") yhalf = 1;
    else if (a == "--mid") mid = 1;
    else if (a == "--fold") fold = 1;
    else {
      fprintf(stderr,
              "usage: %s [--reps N] [--stages S] [--variants v,...] [--no-shapes] [--seed N] "
              "[--json PATH] [--copy-mb MB] [--evict-first] [--packed] [--release-red] "
              "[--balanced] [--teams 1|2] [--x-shared] [--y-half] [--mid] [--fold]\n",
              argv[0]);
      return 2;
    }
  }
  if (reps < 3 || stages < 2 || (teams != 1 && teams != 2) || (teams == 2 && stages % 2)) {
    fprintf(stderr, "--reps >= 3, --stages >= 2, --teams 1 or 2 (2: an even --stages)\n");
    return 2;
  }
  if ((xshared && teams != 2) || (balanced && (xshared || yhalf)) ||
      ((mid || fold) && (balanced || yhalf)) || (mid && fold)) {
    fprintf(stderr, "--x-shared needs --teams 2; --balanced takes neither --x-shared nor "
                    "--y-half; --mid and --fold take none of --balanced, --y-half and each "
                    "other\n");
    return 2;
  }
  const int threads = (kCW * teams + 1) * 32;
  using Kern = void (*)(const Params);
  const Kern kerns[2][4] = {{stream_gemv<1, 0>, stream_gemv<1, 0>, stream_gemv<1, 2>,
                             stream_gemv<1, 2>},
                            {stream_gemv<2, 0>, stream_gemv<2, 1>, stream_gemv<2, 2>,
                             stream_gemv<2, 3>}};
  const Kern kern = kerns[teams - 1][xshared + 2 * yhalf];

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int smem =
      stages * kSlotBytes + kCW * teams * (kXsWarp + 2 * kRows * 4) + 2 * stages * 8;
  if (smem > static_cast<int>(prop.sharedMemPerBlockOptin)) {
    fprintf(stderr, "--stages %d needs %d B of shared memory, the card has %zu\n", stages, smem,
            prop.sharedMemPerBlockOptin);
    return 2;
  }
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, threads, smem));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, kern));
  const int grid = prop.multiProcessorCount;  // one CTA an SM
  if (occ < 1) {
    fprintf(stderr, "no CTA fits an SM\n");
    return 1;
  }

  // The step's 257 GEMVs.
  std::vector<Layer> layers;
  for (int blk = 0; blk < 16; ++blk) {
    for (int l = 0; l < 3; ++l) {
      layers.push_back({16480, 5120, "in_proj"});
      layers.push_back({5120, 6144, "out_proj"});
      layers.push_back({34816, 5120, "gate_up"});
      layers.push_back({5120, 17408, "down"});
    }
    layers.push_back({14336, 5120, "qkv"});
    layers.push_back({5120, 6144, "o_proj"});
    layers.push_back({34816, 5120, "gate_up"});
    layers.push_back({5120, 17408, "down"});
  }
  layers.push_back({248320, 5120, "lm_head"});
  for (const Layer& L : layers)  // a cut tile has two parts at most: a CTA's share >= a tile
    if (balanced && static_cast<int64_t>(L.n / kRows) * (L.k / kChunk) / grid < L.k / kChunk) {
      fprintf(stderr, "--balanced: %s gives a CTA less than a tile on %d SMs\n", L.name, grid);
      return 2;
    }
  const int total = static_cast<int>(layers.size());
  std::vector<int64_t> woff(total), soff(total), wbytes(total), yoff(total);
  int64_t bytes = 0, ys = 0;
  for (int j = 0; j < total; ++j) {
    woff[j] = bytes;
    bytes += static_cast<int64_t>(layers[j].n) * layers[j].k / 2;
    soff[j] = bytes;
    bytes += static_cast<int64_t>(layers[j].n) * (layers[j].k / 64) * 4;
    wbytes[j] = bytes - woff[j];
    bytes = (bytes + 255) / 256 * 256;
    yoff[j] = ys;
    ys += (layers[j].n + 63) / 64 * 64;
  }
  uint8_t* wbuf;
  float *ybuf, *y1buf, *xin;
  __half* y16buf;
  unsigned *bar, *cnt, *expect, *sink;
  CK(cudaMalloc(&wbuf, bytes));
  CK(cudaMalloc(&ybuf, ys * 4));
  CK(cudaMalloc(&y1buf, ys * 4));
  CK(cudaMalloc(&y16buf, ys * 2));
  CK(cudaMalloc(&xin, kMaxK * 4));
  const int max_items = 512;
  CK(cudaMalloc(&bar, max_items * 4));
  CK(cudaMalloc(&cnt, max_items * kCntStride * 4));
  CK(cudaMalloc(&expect, max_items * kCntStride * 4));
  CK(cudaMalloc(&sink, 16));
  for (int j = 0; j < total; ++j) {
    // packed: the stage layout interleaves codes and scales over the whole range (9/16 B a
    // weight), so the codes' fill covers it all and the scales go to their packed slots
    const int64_t nk = static_cast<int64_t>(layers[j].n) * layers[j].k;
    fill_codes<<<2048, 256>>>(reinterpret_cast<uint4*>(wbuf + woff[j]),
                              packed ? nk * 9 / 256 : nk / 32, seed * 1000 + j);
    if (packed)
      fill_scales_packed<<<2048, 256>>>(wbuf + woff[j], layers[j].n, layers[j].k,
                                        seed * 7000 + j);
    else
      fill_scales<<<2048, 256>>>(reinterpret_cast<float*>(wbuf + soff[j]),
                                 nk / 64, layers[j].k, seed * 7000 + j);
  }
  fill_x<<<64, 256>>>(xin, kMaxK, seed);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<Gemv> hg(total);
  for (int j = 0; j < total; ++j)
    hg[j] = Gemv{wbuf + woff[j], reinterpret_cast<const float*>(wbuf + soff[j]), ybuf + yoff[j],
                 y1buf + yoff[j], y16buf + yoff[j], layers[j].n, layers[j].k};
  Gemv* dg;
  CK(cudaMalloc(&dg, total * sizeof(Gemv)));
  CK(cudaMemcpy(dg, hg.data(), total * sizeof(Gemv), cudaMemcpyHostToDevice));
  Item* ditems;
  CK(cudaMalloc(&ditems, max_items * sizeof(Item)));
  double* dref;
  CK(cudaMalloc(&dref, 248320 * 8));
  float* xtmp;  // --fold's check: the normalized x the reference multiplies
  CK(cudaMalloc(&xtmp, 248320 * 4));

  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_it = [&](auto&& launch, int n) {
    for (int w = 0; w < 2; ++w) launch();
    CK(cudaStreamSynchronize(st));
    std::vector<double> us;
    for (int i = 0; i < n; ++i) {
      CK(cudaEventRecord(e0, st));
      launch();
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(ms * 1e3);
    }
    CK(cudaGetLastError());
    return us;
  };

  // The copy ceiling: (read + written) / time of a large device-to-device copy.
  void *csrc, *cdst;
  const size_t cbytes = static_cast<size_t>(copy_mb) << 20;
  CK(cudaMalloc(&csrc, cbytes));
  CK(cudaMalloc(&cdst, cbytes));
  CK(cudaMemset(csrc, 0x5a, cbytes));
  const double copy_us = median(time_it(
      [&] { CK(cudaMemcpyAsync(cdst, csrc, cbytes, cudaMemcpyDeviceToDevice, st)); }, 9));
  const double copy_tbps = 2.0 * cbytes / copy_us / 1e6;
  CK(cudaFree(csrc));
  CK(cudaFree(cdst));
  printf("device %s, %d SMs, L2 %d MB; kernel: %d regs, %d B local, %d B smem (%d stages), "
         "grid %d x %d, %d CTAs fit an SM\n",
         prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, fa.numRegs,
         static_cast<int>(fa.localSizeBytes), smem, stages, grid, threads, occ);
  printf("copy ceiling: %.1f us for %d MiB -> %.3f TB/s (read + written)\n", copy_us, copy_mb,
         copy_tbps);
  fflush(stdout);

  // Sequences: the chain, and each shape alone.
  struct Seq {
    std::string name;
    std::vector<int> g;
  };
  std::vector<Seq> seqs;
  {
    Seq c{"chain (257 GEMVs)", {}};
    for (int j = 0; j < total; ++j) c.g.push_back(j);
    seqs.push_back(c);
  }
  if (shapes) {
    const char* names[] = {"in_proj 16480x5120", "out_proj|o_proj 5120x6144",
                           "gate_up 34816x5120", "down 5120x17408", "qkv 14336x5120",
                           "lm_head 248320x5120"};
    const char* keys[][2] = {{"in_proj", ""},  {"out_proj", "o_proj"}, {"gate_up", ""},
                             {"down", ""},     {"qkv", ""},            {"lm_head", ""}};
    for (int sh = 0; sh < 6; ++sh) {
      Seq q{names[sh], {}};
      for (int j = 0; j < total; ++j)
        if (!strcmp(layers[j].name, keys[sh][0]) || !strcmp(layers[j].name, keys[sh][1]))
          q.g.push_back(j);
      seqs.push_back(q);
    }
  }

  std::vector<std::string> vlist;
  for (size_t a = 0; a <= variants.size();) {
    size_t e = variants.find(',', a);
    if (e == std::string::npos) e = variants.size();
    if (e > a) vlist.push_back(variants.substr(a, e - a));
    a = e + 1;
  }

  FILE* js = json_path.empty() ? nullptr : fopen(json_path.c_str(), "w");
  if (js)
    fprintf(js,
            "{\"device\": \"%s\", \"sms\": %d, \"regs\": %d, \"local_bytes\": %d, "
            "\"smem_bytes\": %d, \"stages\": %d, \"evict_first\": %d, \"packed\": %d, "
            "\"release_red\": %d, \"balanced\": %d, \"teams\": %d, \"x_shared\": %d, "
            "\"y_half\": %d, \"seed\": %llu, \"copy_ceiling_tbps\": %.4f, "
            "\"copy_us\": %.2f, \"copy_mib\": %d, \"sequences\": [\n",
            prop.name, prop.multiProcessorCount, fa.numRegs, static_cast<int>(fa.localSizeBytes),
            smem, stages, hint, packed, relred, balanced, teams, xshared, yhalf,
            static_cast<unsigned long long>(seed), copy_tbps, copy_us, copy_mb);

  struct Row {
    std::string seq, var;
    double us, tbps, fcopy, fread, err;
    bool det;
  };
  std::vector<Row> rows;
  for (size_t qi = 0; qi < seqs.size(); ++qi) {
    const Seq& q = seqs[qi];
    const int n = static_cast<int>(q.g.size());
    std::vector<Item> items(n);
    std::vector<unsigned> hexp(n * kCntStride, 0);
    int64_t tiles = 0, qbytes = 0;
    for (int s = 0; s < n; ++s) {
      const int j = q.g[s];
      items[s] = Item{j, s > 0 ? q.g[s - 1] : -1, static_cast<int>(tiles % grid), 0};
      tiles += layers[j].n / kRows;
      qbytes += wbytes[j];
      if (s > 0) {
        const Layer& P = layers[q.g[s - 1]];
        for (int c = 0; c < layers[j].k / kChunk; ++c)
          for (int r0 = 0; r0 < P.n; r0 += kRows)
            hexp[s * kCntStride + c] += feeds(r0, P.n, layers[j].k, c);
      }
    }
    CK(cudaMemcpy(ditems, items.data(), n * sizeof(Item), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(expect, hexp.data(), n * kCntStride * 4, cudaMemcpyHostToDevice));

    // The read-only stream of the same bytes.
    std::vector<Blk> hb;
    for (int s = 0; s < n; ++s) {
      const int j = q.g[s];
      for (int64_t o = 0; o < wbytes[j]; o += 256 << 10)
        hb.push_back(Blk{reinterpret_cast<const uint4*>(wbuf + woff[j] + o),
                         std::min<int64_t>(256 << 10, wbytes[j] - o) / 16});
    }
    Blk* db;
    CK(cudaMalloc(&db, hb.size() * sizeof(Blk)));
    CK(cudaMemcpy(db, hb.data(), hb.size() * sizeof(Blk), cudaMemcpyHostToDevice));
    const double read_us = median(time_it(
        [&] {
          read_blocks<<<prop.multiProcessorCount * 8, 256, 0, st>>>(
              db, static_cast<int>(hb.size()), sink);
        },
        reps));
    const double read_tbps = qbytes / read_us / 1e6;
    CK(cudaFree(db));
    printf("\n== %s: %d GEMVs, %.3f GB; read stream %.1f us, %.3f TB/s (%.1f%% of copy)\n",
           q.name.c_str(), n, qbytes / 1e9, read_us, read_tbps, 100 * read_tbps / copy_tbps);
    fflush(stdout);
    if (js)
      fprintf(js,
              "%s  {\"name\": \"%s\", \"gemvs\": %d, \"bytes\": %lld, \"read_stream_us\": %.2f, "
              "\"read_stream_tbps\": %.4f, \"read_stream_of_copy\": %.4f, \"variants\": [\n",
              qi ? ",\n" : "", q.name.c_str(), n, static_cast<long long>(qbytes), read_us,
              read_tbps, read_tbps / copy_tbps);

    bool first_v = true;
    for (const std::string& v : vlist) {
      int mode, pf, nomath = 0, norestage = 0, pdl = 0;
      if (v == "stream") mode = kStream, pf = 1;
      else if (v == "feed") mode = kStream, pf = 1, nomath = 1;
      else if (v == "barrier") mode = kBarrier, pf = 0;
      else if (v == "barrier_pf") mode = kBarrier, pf = 1;
      else if (v == "barrier_nx") mode = kBarrier, pf = 1, norestage = 1;
      else if (v == "flags") mode = kFlags, pf = 0;
      else if (v == "flags_pf") mode = kFlags, pf = 1;
      else if (v == "graph") mode = kNoWait, pf = 1;
      else if (v == "pdl") mode = kNoWait, pf = 1, pdl = 1;
      else {
        fprintf(stderr, "unknown variant %s\n", v.c_str());
        return 2;
      }
      if ((balanced || xshared) && mode == kFlags) {  // balanced: a cut tile has no single
        // finisher to publish it; x-shared: the flags stage a chunk a warp, lazily
        fprintf(stderr, "neither --balanced nor --x-shared takes the flags variants\n");
        return 2;
      }
      CK(cudaMemsetAsync(bar, 0, max_items * 4, st));
      CK(cudaMemsetAsync(cnt, 0, max_items * kCntStride * 4, st));
      unsigned epoch = 0;
      Params prm{dg, ditems, n, mode, pf, 0, bar, cnt, expect, xin, stages, nomath, hint, packed,
                 relred, balanced, norestage, 0, mode == kNoWait ? mid : 0,
                 mode == kNoWait ? fold : 0};
      cudaGraphExec_t exec = nullptr;
      if (mode == kNoWait) {  // one launch a GEMV, captured as a graph (pdl: chained)
        cudaGraph_t gr;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int s = 0; s < n; ++s) {
          Params one = prm;
          one.items = ditems + s;
          one.count = 1;
          if (pdl && s > 0) {  // a programmatic dependent of the launch before it
            one.pdl = 1;
            CK(launch_dependent(st, grid, threads, smem, kern, one));
          } else {
            one.pdl = pdl;  // the first launch triggers its dependent too
            kern<<<grid, threads, smem, st>>>(one);
          }
          if (mid && s + 1 < n) {  // the small op between this GEMV and the next
            const Gemv& gv = hg[q.g[s]];
            if (pdl) {
              CK(launch_dependent(st, 1, 1024, 0, mid_norm, static_cast<const float*>(gv.y),
                                  gv.y1, gv.n, 1));
            } else {
              mid_norm<<<1, 1024, 0, st>>>(gv.y, gv.y1, gv.n, 0);
            }
          }
        }
        CK(cudaStreamEndCapture(st, &gr));
        CK(cudaGraphInstantiate(&exec, gr, 0));
        CK(cudaGraphDestroy(gr));
      }
      auto launch = [&] {
        if (exec) {
          CK(cudaGraphLaunch(exec, st));
          return;
        }
        prm.epoch = ++epoch;
        void* args[] = {&prm};
        CK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kern), grid, threads, args,
                                       smem, st));
      };
      const std::vector<double> us = time_it(launch, reps);
      const double med = median(us);
      const double mn = *std::min_element(us.begin(), us.end());
      const double mx = *std::max_element(us.begin(), us.end());

      // The check: poisoned outputs, one launch, sampled GEMVs against f64; then a second
      // poisoned launch, every output compared bitwise.
      CK(cudaMemsetAsync(ybuf, 0xff, ys * 4, st));
      CK(cudaMemsetAsync(y1buf, 0xff, ys * 4, st));
      CK(cudaMemsetAsync(y16buf, 0xff, ys * 2, st));
      launch();
      CK(cudaStreamSynchronize(st));
      std::vector<float> y1(ys), y2(ys), p1(ys), p2(ys);
      CK(cudaMemcpy(y1.data(), ybuf, ys * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(p1.data(), y1buf, ys * 4, cudaMemcpyDeviceToHost));
      std::vector<float> yc = y1;  // the GEMVs' outputs, the partials added when balanced
      if (balanced)
        for (int64_t i = 0; i < ys; ++i) yc[i] = y1[i] + p1[i];
      std::vector<int> sample;
      for (int s : {0, 1, 2, 3, 12, 13, 14, 15, 100, n - 2, n - 1})
        if (s >= 0 && s < n && std::find(sample.begin(), sample.end(), s) == sample.end())
          sample.push_back(s);
      double worst = 0;
      for (int s : sample) {
        const int j = q.g[s];
        const float* src = xin;
        const float* src1 = nullptr;
        int xn = kMaxK;
        if (mode != kStream && s > 0) {
          src = (mid && mode == kNoWait) ? hg[q.g[s - 1]].y1 : hg[q.g[s - 1]].y;
          if (fold && mode == kNoWait) {  // the reference's x: the previous y normalized
            mid_norm<<<1, 1024, 0, st>>>(hg[q.g[s - 1]].y, xtmp, layers[q.g[s - 1]].n, 0);
            src = xtmp;
          }
          if (balanced) src1 = hg[q.g[s - 1]].y1;
          xn = layers[q.g[s - 1]].n;
        }
        reference<<<(layers[j].n + 7) / 8, 256, 0, st>>>(hg[j], src, src1, xn, dref, packed);
        CK(cudaGetLastError());
        std::vector<double> ref(layers[j].n);
        CK(cudaMemcpyAsync(ref.data(), dref, layers[j].n * 8, cudaMemcpyDeviceToHost, st));
        CK(cudaStreamSynchronize(st));
        double num = 0, den = 0;
        for (int r = 0; r < layers[j].n; ++r) {
          const double dlt = yc[yoff[j] + r] - ref[r];
          num += dlt * dlt;
          den += ref[r] * ref[r];
        }
        const double e = std::sqrt(num / den);
        worst = std::isnan(e) || std::isnan(worst) ? NAN : std::max(worst, e);
      }
      CK(cudaMemsetAsync(ybuf, 0xff, ys * 4, st));
      CK(cudaMemsetAsync(y1buf, 0xff, ys * 4, st));
      CK(cudaMemsetAsync(y16buf, 0xff, ys * 2, st));
      launch();
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(y2.data(), ybuf, ys * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(p2.data(), y1buf, ys * 4, cudaMemcpyDeviceToHost));
      bool det = true;
      for (int s = 0; s < n && det; ++s) {
        const int j = q.g[s];
        det = !memcmp(y1.data() + yoff[j], y2.data() + yoff[j], layers[j].n * 4) &&
              (!balanced || !memcmp(p1.data() + yoff[j], p2.data() + yoff[j], layers[j].n * 4));
      }
      if (exec) CK(cudaGraphExecDestroy(exec));

      const double tbps = qbytes / med / 1e6;
      rows.push_back({q.name, v, med, tbps, tbps / copy_tbps, tbps / read_tbps, worst, det});
      printf("  %-10s %9.1f us (min %.1f, max %.1f)  %.3f TB/s  %5.1f%% of copy  %5.1f%% of "
             "read  err %.2e  %s\n",
             v.c_str(), med, mn, mx, tbps, 100 * tbps / copy_tbps, 100 * tbps / read_tbps, worst,
             det ? "bitwise-repeatable" : "NOT REPEATABLE");
      fflush(stdout);
      if (js)
        fprintf(js,
                "%s    {\"variant\": \"%s\", \"us\": %.2f, \"us_min\": %.2f, \"us_max\": %.2f, "
                "\"tbps\": %.4f, \"of_copy\": %.4f, \"of_read_stream\": %.4f, "
                "\"rel_err_l2\": %.3e, \"checked_gemvs\": %zu, \"bitwise_repeatable\": %s}",
                first_v ? "" : ",\n", v.c_str(), med, mn, mx, tbps, tbps / copy_tbps,
                tbps / read_tbps, std::isnan(worst) ? 1e30 : worst, sample.size(),
                det ? "true" : "false");
      first_v = false;
    }
    if (js) fprintf(js, "\n  ]}");
  }
  if (js) {
    fprintf(js, "\n]}\n");
    fclose(js);
  }

  printf("\n%-28s %-10s %9s %7s %7s %7s %9s\n", "sequence", "variant", "us", "TB/s", "copy%",
         "read%", "err");
  for (const Row& r : rows)
    printf("%-28s %-10s %9.1f %7.3f %6.1f%% %6.1f%% %9.2e%s\n", r.seq.c_str(), r.var.c_str(),
           r.us, r.tbps, 100 * r.fcopy, 100 * r.fread, r.err, r.det ? "" : " NONDET");
  printf("copy ceiling %.3f TB/s on %s\n", copy_tbps, prop.name);
  return 0;
}
