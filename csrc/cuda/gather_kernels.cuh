// The checked gather of gather.cu; internal. Only thread indexing and three atomics are
// used, so tests/cuda_host/ compiles it as plain C++ and runs it thread by thread
// (tests/test_cuda_emulated.py).
#ifndef DISTEMB_CUDA_GATHER_KERNELS_CUH_
#define DISTEMB_CUDA_GATHER_KERNELS_CUH_

#include <cstdint>

#include "indexing.cuh"

namespace distemb {
namespace {

// As gather_kernel, but an id outside [0, num_rows) reads a row of zeros and is counted
// in flags (count, smallest, largest) instead of faulting, so ids are validated on the
// device without stopping the stream; the host reads flags whenever it next waits.
__global__ void gather_checked_kernel(const float* table, int64_t num_rows, int64_t d,
                                      const int64_t* rows, int64_t n, int lanes, float* out,
                                      long long* flags) {
  const int lane = threadIdx.x % lanes;
  for (int64_t i = first_row(lanes); i < n; i += row_stride(lanes)) {
    const int64_t r = rows[i];
    float* dst = out + i * d;
    if (r < 0 || r >= num_rows) {
      if (lane == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(flags), 1ull);
        atomicMin(flags + 1, static_cast<long long>(r));
        atomicMax(flags + 2, static_cast<long long>(r));
      }
      for (int64_t j = lane; j < d; j += lanes) dst[j] = 0.0f;
      continue;
    }
    const float* src = table + r * d;
    for (int64_t j = lane; j < d; j += lanes) dst[j] = src[j];
  }
}

}  // namespace
}  // namespace distemb

#endif  // DISTEMB_CUDA_GATHER_KERNELS_CUH_
