// What the standalone CUDA labs under bench/ share: a CUDA call checked (the file, the line and
// the error, then exit 1) and the GPU's nanosecond clock.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(...) CK1((__VA_ARGS__))
#define CK1(e)                                                                          \
  do {                                                                                  \
    cudaError_t err_ = (e);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));      \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

__device__ __forceinline__ unsigned long long lab_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
