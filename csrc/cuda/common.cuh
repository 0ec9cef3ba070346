// Launch helpers shared by the .cu files; internal, not part of the C API.
#ifndef DISTEMB_CUDA_COMMON_CUH_
#define DISTEMB_CUDA_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "distemb_cuda.h"
#include "indexing.cuh"

namespace distemb {

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ inline float warp_sum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

}  // namespace distemb

// Return the CUDA error of `expr` from the enclosing C entry point.
#define DISTEMB_TRY(expr)                                  \
  do {                                                     \
    cudaError_t distemb_err_ = (expr);                     \
    if (distemb_err_ != cudaSuccess) return distemb_err_;  \
  } while (0)

#endif  // DISTEMB_CUDA_COMMON_CUH_
