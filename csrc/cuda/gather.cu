// Row gather and the library's utility entry points.
#include "common.cuh"

namespace distemb {
namespace {

__global__ void gather_kernel(const float* table, int64_t d, const int64_t* rows,
                              int64_t total, float* out) {
  for (int64_t t = thread_index(); t < total; t += thread_count()) {
    const int64_t i = t / d;
    out[t] = table[rows[i] * d + (t - i * d)];
  }
}

}  // namespace
}  // namespace distemb

DISTEMB_API int distemb_cuda_abi_version(void) { return DISTEMB_CUDA_ABI_VERSION; }

DISTEMB_API const char* distemb_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

DISTEMB_API int distemb_cuda_device_count(int* count_host) {
  if (count_host == nullptr) return cudaErrorInvalidValue;
  *count_host = 0;
  return cudaGetDeviceCount(count_host);
}

DISTEMB_API int distemb_cuda_gather_rows(const float* table, int64_t d, const int64_t* rows,
                                         int64_t n, float* out, int device, void* stream) {
  if (n < 0 || d <= 0) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  distemb::gather_kernel<<<distemb::blocks_for(n * d), distemb::kThreads, 0,
                           distemb::as_stream(stream)>>>(table, d, rows, n * d, out);
  return cudaGetLastError();
}
