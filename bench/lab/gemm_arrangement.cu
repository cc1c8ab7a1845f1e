// gemm_arrangement: which warp arrangement should the int4 GEMM of prefill pieces launch?
// (issue 44, a new turn's fixed cost). At 64 rows the op spends ~2.6 us a 128-input stage on a
// multiprocessor (24% of the copy ceiling), and at 16 rows nearly as much: the constant part
// (each warp makes its codes bf16, and under the op's arrangement two warps make the same
// codes) weighs more than the tensor-core work. This times the op's own kernel
// (engine/kernels/cuda/int4_gemv.cu, included whole) under three arrangements of its warps:
//   rw2/half  two m16 row sets against half the n8 tiles (16 warps; the op's from a147b86 to run 1)
//   rw1/all   one row set against all the tiles (16 warps; codes made bf16 once, x's tiles read
//             from shared memory by every warp)
//   rw2/all   two row sets against all the tiles (8 warps, up to 255 registers; codes once,
//             x read half as often as rw1/all; the op's since run 1)
// and each again with x staged by cp.async beside the codes (`+xp`: x permuted beforehand, as
// the caller would with a reshape and a transpose, instead of through registers),
// on the 64-wide piece's shapes at 16, 32, 48 and 64 rows, each with the op's K split
// (cuda_ops.gemm_splits), every arrangement's partial sums compared bitwise with rw2/half's
// (the same products in the same order), and the copy ceiling measured in the same process.
//
// Build and run on the GPU machine (the XLA FFI headers come from jaxlib):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -Xptxas -v \
//        -I"$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
//        bench/lab/gemm_arrangement.cu -o /tmp/gemm_arr
//   /tmp/gemm_arr [--reps 20] [--json out.json]
#include "../../engine/kernels/cuda/int4_gemv.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));     \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace lab {

struct Shape {
  const char* name;
  int n, k;
};
// the 27B layer's int4 GEMMs of one input (their outputs concatenated, as the op takes them)
const Shape kShapes[] = {{"mlp gate|up", 34816, 5120},
                         {"mlp down", 5120, 17408},
                         {"gdn in_proj", 16480, 5120},
                         {"attn q|k|v", 14336, 5120},
                         {"out_proj", 5120, 6144},
                         {"tail", 1000, 5120}};  // a partial tile; x of fewer rows than Mp

// rows of x a width computes: Mp = 8 MT, except on the tail shape (Mp - 11: 5, 21, 37, 53)
int rows_for(const Shape& sh, int mp) { return std::strcmp(sh.name, "tail") ? mp : mp - 11; }

// cuda_ops.gemm_splits: the fewest stage-times on the busiest multiprocessor, whole waves of
// 132 blocks, plus the fp32 partials each extra part writes and XLA reads back
int splits_for(int n, int k, int m) {
  const int tiles = (n + 255) / 256, steps = k / 128;
  const double stage_bytes = 132.0 * (256 * 128 / 2 + 256 * 8);
  int best = 1;
  double best_cost = 1e300;
  for (int s = 1; s <= std::max(1, steps / 4); ++s) {
    const double waves = (tiles * s + 131) / 132;
    const double parts = s > 1 ? 2.0 * s * m * n * 4 / stage_bytes : 0;
    const double cost = waves * ((steps + s - 1) / s) + parts;
    if (cost < best_cost) best_cost = cost, best = s;
  }
  return best;
}

using Launch = cudaError_t (*)(cudaStream_t, const __nv_bfloat16*, const Mats&, const int32_t*,
                               float*, int, int, int);
struct Arr {
  const char* name;
  Launch launch;
  const void* kernel;
  bool xp;
};

template <int MT, int RW, int TW, bool XP>
Arr arrangement(const char* name) {
  return {name, launch_gemm<MT, GemmWarps<MT, RW, TW, XP>>,
          reinterpret_cast<const void*>(int4_gemm<MT, RW, TW, XP>), XP};
}

template <int MT>
std::vector<Arr> arrangements() {
  return {arrangement<MT, 2, MT / 2, false>("rw2/half"), arrangement<MT, 1, MT, false>("rw1/all"),
          arrangement<MT, 2, MT, false>("rw2/all"), arrangement<MT, 2, MT / 2, true>("rw2/half+xp"),
          arrangement<MT, 1, MT, true>("rw1/all+xp"), arrangement<MT, 2, MT, true>("rw2/all+xp")};
}

std::vector<Arr> arrangements_for(int mt) {
  switch (mt) {
    case 2: return arrangements<2>();
    case 4: return arrangements<4>();
    case 6: return arrangements<6>();
    default: return arrangements<8>();
  }
}

double copy_ceiling(cudaStream_t st) {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int r = 0; r < 6; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r > 0 && ms < best) best = ms;
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (best * 1e-3);
}

}  // namespace lab

int main(int argc, char** argv) {
  using namespace lab;
  int reps = 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else { std::fprintf(stderr, "usage: %s [--reps N] [--json PATH]\n", argv[0]); return 2; }
  }
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double ceiling = copy_ceiling(st);
  std::printf("device %s, %d SMs; copy ceiling %.3f TB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, ceiling / 1e12);
  FILE* out = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
  if (out)
    std::fprintf(out, "{\"device\": \"%s\", \"copy_ceiling_tbps\": %.4f, \"reps\": %d, \"rows\": [",
                 prop.name, ceiling / 1e12, reps);
  bool first = true, all_equal = true;
  int32_t* index;
  CK(cudaMalloc(&index, 4));
  CK(cudaMemset(index, 0, 4));
  std::printf("%-12s %3s %-11s %6s %5s %6s %9s %7s %s\n", "shape", "M", "arr", "splits", "regs",
              "spill", "us", "ceiling", "bitwise");
  for (const Shape& sh : kShapes) {
    const size_t wbytes = size_t(sh.n) * sh.k / 2, sbytes = size_t(sh.n) * (sh.k / 64) * 4;
    const int copies = std::max<int>(2, int((size_t(240) << 20) / (wbytes + sbytes)) + 1);
    std::vector<uint8_t*> w(copies);
    std::vector<float*> s(copies);
    std::vector<uint8_t> hw(wbytes);
    std::vector<float> hs(sbytes / 4);
    uint64_t seed = 0x9E3779B97F4A7C15ull ^ sh.n;
    auto next = [&] { seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; return seed; };
    for (auto& b : hw) b = uint8_t(next());
    for (auto& v : hs) v = 0.002f + float(next() % 1000) * 1e-5f;
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&w[c], wbytes));
      CK(cudaMalloc(&s[c], sbytes));
      CK(cudaMemcpy(w[c], hw.data(), wbytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(s[c], hs.data(), sbytes, cudaMemcpyHostToDevice));
    }
    for (int mt = 2; mt <= 8; mt += 2) {
      const int mp = 8 * mt, m = rows_for(sh, mp), splits = splits_for(sh.n, sh.k, m);
      std::vector<__nv_bfloat16> hx(size_t(mp) * sh.k);
      for (auto& v : hx) v = __float2bfloat16(float(int(next() % 2001) - 1000) * 1e-3f);
      // B's order: each 16 inputs' 4 x 4 transposed (input 4a + b at 4b + a)
      std::vector<__nv_bfloat16> hxp(hx.size());
      for (size_t i = 0; i < hx.size(); ++i)
        hxp[(i & ~size_t(15)) + 4 * (i & 3) + ((i >> 2) & 3)] = hx[i];
      __nv_bfloat16 *x, *xp;
      float* y;
      const size_t ysize = size_t(splits) * m * sh.n;
      CK(cudaMalloc(&x, hx.size() * 2));
      CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&xp, hx.size() * 2));
      CK(cudaMemcpy(xp, hxp.data(), hx.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&y, ysize * 4));
      std::vector<float> base(ysize), got(ysize);
      auto mats = [&](int c) {
        Mats mm{};
        mm.w[0] = w[c];
        mm.s[0] = s[c];
        mm.start[0] = 0;
        mm.start[1] = sh.n;
        mm.count = 1;
        mm.nlead = 0;
        return mm;
      };
      int ai = 0;
      for (const Arr& a : arrangements_for(mt)) {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, a.kernel));
        CK(cudaMemset(y, 0, ysize * 4));
        const __nv_bfloat16* xa = a.xp ? xp : x;
        CK(a.launch(st, xa, mats(0), index, y, m, sh.k, splits));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(ai == 0 ? base.data() : got.data(), y, ysize * 4, cudaMemcpyDeviceToHost));
        const bool equal = ai == 0 || !std::memcmp(base.data(), got.data(), ysize * 4);
        all_equal = all_equal && equal;
        for (int r = 0; r < 3; ++r)
          CK(a.launch(st, xa, mats(r % copies), index, y, m, sh.k, splits));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0, st));
        for (int r = 0; r < reps; ++r)
          CK(a.launch(st, xa, mats(r % copies), index, y, m, sh.k, splits));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const double us = 1e3 * ms / reps, frac = (wbytes + sbytes) / (us * 1e-6) / ceiling;
        std::printf("%-12s %3d %-11s %6d %5d %6zu %9.1f %6.1f%% %s\n", sh.name, m, a.name, splits,
                    fa.numRegs, size_t(fa.localSizeBytes), us, 100 * frac,
                    equal ? "equal" : "DIFFERENT");
        if (out)
          std::fprintf(out,
                       "%s{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"arrangement\": "
                       "\"%s\", \"splits\": %d, \"regs\": %d, \"local_bytes\": %zu, \"us\": %.2f, "
                       "\"ceiling_fraction\": %.4f, \"bitwise_equal_to_rw2_half\": %s}",
                       first ? "" : ", ", sh.name, sh.n, sh.k, m, a.name, splits, fa.numRegs,
                       size_t(fa.localSizeBytes), us, frac, equal ? "true" : "false");
        first = false;
        ++ai;
      }
      CK(cudaFree(x));
      CK(cudaFree(xp));
      CK(cudaFree(y));
    }
    for (int c = 0; c < copies; ++c) {
      CK(cudaFree(w[c]));
      CK(cudaFree(s[c]));
    }
  }
  if (out) {
    std::fprintf(out, "], \"all_bitwise_equal\": %s}\n", all_equal ? "true" : "false");
    std::fclose(out);
  }
  std::printf("all arrangements bitwise equal to rw2/half: %s\n", all_equal ? "yes" : "NO");
  return all_equal ? 0 : 1;
}
