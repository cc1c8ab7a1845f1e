// L2 prefetch of the next GEMV's weights, as an XLA FFI custom call on CUDA.
//
//   y = x   (the output aliases the input; a copy only where XLA could not alias them)
//
// and, on the side, the first rows[j] rows of one layer of each stacked operand j (a weight's
// codes or scales, [*lead, N, C] of any dtype, the layer picked by the int32 `index` read on
// the device, the same index the GEMV takes, + `offset`) are asked into L2. Nothing waits
// for them.
//
// Why: a decode step's GEMVs stream ~14.8 GB of weights at 1.6-2.5 TB/s of the 4.3 TB/s a
// copy reaches, bound by the latency of their loads (docs/benchmarks/README.md v19), while
// between them ~1.9 ms of small kernels, the GDN kernel and attention leave the HBM idle.
// Placed between a GEMV's output and its consumers (x), this call fills the next GEMV's first
// bytes into L2 during that idle time, and the GEMV then reads them at L2 latency.
//
// mode (`mode` attribute):
//   1: one `prefetch.global.L2` a `step` bytes (32 or 128), grid-strided over all threads;
//   2: the same with `prefetch.global.L2::evict_last` (the lines outlast streaming reads);
//   3: `cp.async.bulk.prefetch.L2.global` (sm_90), one bulk request of `step` bytes a thread
//      (a multiple of 16), so a few threads of every SM feed the copy engines.
// A region's start is 16-byte aligned (XLA's buffers are), its length rounded down to 16.
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRegions = 8;
constexpr int kThreads = 256;

struct Regions {
  const char* base[kMaxRegions];  // the stack's first element
  int64_t layer_bytes[kMaxRegions];  // bytes of one layer (N * C * itemsize)
  int64_t bytes[kMaxRegions];        // bytes to prefetch from the layer's start
  int64_t layers[kMaxRegions];       // layers in the stack (the flat index is clamped below)
  int64_t mult[kMaxRegions][3];      // flat layer = sum index[d] * mult[r][d] (+ offset)
  int count;
  int nlead;
  int offset;  // added to the flat layer (1: the next layer's weights)
};

__device__ __forceinline__ const char* region_start(const Regions& r, int j,
                                                    const int32_t* __restrict__ index) {
  int64_t layer = r.offset;
  for (int d = 0; d < r.nlead; ++d) layer += static_cast<int64_t>(index[d]) * r.mult[j][d];
  layer = layer < 0 ? 0 : layer >= r.layers[j] ? r.layers[j] - 1 : layer;
  return r.base[j] + layer * r.layer_bytes[j];
}

template <int kMode>
__global__ void __launch_bounds__(kThreads)
    l2_prefetch_kernel(const __grid_constant__ Regions r, const int32_t* __restrict__ index,
                       int64_t step) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // regions one after another in one flat range of steps, so the threads share them evenly
  int64_t first = 0;
  for (int j = 0; j < r.count; ++j) {
    const int64_t steps = (r.bytes[j] + step - 1) / step;
    if (steps == 0) continue;
    const char* p = region_start(r, j, index);
    // this thread's first step in region j: the smallest s >= 0 with (first + s) % threads == tid
    int64_t s = (tid - first % threads + threads) % threads;
    for (; s < steps; s += threads) {
      const char* a = p + s * step;
      if constexpr (kMode == 1) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
      } else if constexpr (kMode == 2) {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(a));
      } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        const int64_t left = r.bytes[j] - s * step;
        const uint32_t n = static_cast<uint32_t>((left < step ? left : step) & ~int64_t{15});
        if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n)
                            : "memory");
#else
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
#endif
      }
    }
    first += steps;
  }
}

// x (any), index (s32, one entry a stack dim), then the stacks: each [*lead (`lead` dims),
// N, C], of which the first min(rows[j], N) rows (all with rows[j] < 0) of the layer at
// index (+ `offset`, clamped to the stack) are prefetched. y: x's shape and type.
ffi::Error L2PrefetchImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                          ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> y, int64_t lead,
                          ffi::Span<const int64_t> rows, int64_t offset, int64_t mode, int64_t step,
                          int64_t blocks) {
  if (x.size_bytes() != y->size_bytes())
    return ffi::Error::InvalidArgument("l2_prefetch: y must be x's shape and type");
  if (x.untyped_data() != y->untyped_data()) {
    // XLA did not alias them: y is a copy of x, in stream order
    const cudaError_t e = cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (rest.size() < 1 || rest.size() > kMaxRegions || rows.size() != rest.size())
    return ffi::Error::InvalidArgument("l2_prefetch: 1..8 stacks to prefetch, rows for each");
  if (lead < 0 || lead > 3 || index.element_count() < static_cast<size_t>(lead))
    return ffi::Error::InvalidArgument("l2_prefetch: lead 0..3, index one entry a stack dim");
  if (mode < 1 || mode > 3)
    return ffi::Error::InvalidArgument("l2_prefetch: mode 1, 2 or 3");
  if (step < 32 || step % 16 != 0 || (mode < 3 && step != 32 && step != 128))
    return ffi::Error::InvalidArgument(
        "l2_prefetch: step 32 or 128 (modes 1, 2), a multiple of 16 (mode 3)");
  if (blocks < 1 || blocks > 4096) return ffi::Error::InvalidArgument("l2_prefetch: blocks 1..4096");
  Regions r{};
  r.count = static_cast<int>(rest.size());
  r.nlead = static_cast<int>(lead);
  r.offset = static_cast<int>(offset);
  for (int j = 0; j < r.count; ++j) {
    auto b = rest.get<ffi::AnyBuffer>(j);
    if (b.has_error()) return ffi::Error::InvalidArgument("l2_prefetch: a stack is not a buffer");
    const auto d = b->dimensions();
    if (static_cast<int64_t>(d.size()) != lead + 2)
      return ffi::Error::InvalidArgument("l2_prefetch: stacks must be [*lead, N, C]");
    int64_t layers = 1;
    for (int64_t e = 0; e < lead; ++e) layers *= d[e];
    const int64_t n = d[lead], row_bytes = static_cast<int64_t>(b->size_bytes()) /
                                           (layers * n > 0 ? layers * n : 1);
    const int64_t take = rows[j] < 0 || rows[j] > n ? n : rows[j];
    r.base[j] = static_cast<const char*>(b->untyped_data());
    r.layer_bytes[j] = n * row_bytes;
    r.bytes[j] = take * row_bytes;
    r.layers[j] = layers;
    for (int64_t e = 0; e < 3; ++e) {
      int64_t m = 1;
      for (int64_t f = e + 1; f < lead; ++f) m *= d[f];
      r.mult[j][e] = e < lead ? m : 0;
    }
  }
  const int nb = static_cast<int>(blocks);
  switch (mode) {
    case 1: l2_prefetch_kernel<1><<<nb, kThreads, 0, stream>>>(r, index.typed_data(), step); break;
    case 2: l2_prefetch_kernel<2><<<nb, kThreads, 0, stream>>>(r, index.typed_data(), step); break;
    default: l2_prefetch_kernel<3><<<nb, kThreads, 0, stream>>>(r, index.typed_data(), step);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferL2Prefetch, L2PrefetchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("lead")
                                  .Attr<ffi::Span<const int64_t>>("rows")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("step")
                                  .Attr<int64_t>("blocks"),
                              {ffi::Traits::kCmdBufferCompatible});
