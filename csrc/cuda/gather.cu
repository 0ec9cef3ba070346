// Row gather and the library's utility entry points.
#include "common.cuh"

namespace distemb {
namespace {

__global__ void gather_kernel(const float* table, int64_t d, const int64_t* rows, int64_t n,
                              int lanes, float* out) {
  const int lane = threadIdx.x % lanes;
  for (int64_t i = first_row(lanes); i < n; i += row_stride(lanes)) {
    const float* src = table + rows[i] * d;
    for (int64_t j = lane; j < d; j += lanes) out[i * d + j] = src[j];
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
  const int lanes = distemb::lanes_per_row(d);
  distemb::gather_kernel<<<distemb::blocks_for(n * lanes), distemb::kThreads, 0,
                           distemb::as_stream(stream)>>>(table, d, rows, n, lanes, out);
  return cudaGetLastError();
}

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

DISTEMB_API int distemb_cuda_gather_rows_checked(const float* table, int64_t num_rows,
                                                 int64_t d, const int64_t* rows, int64_t n,
                                                 float* out, int64_t* flags, int device,
                                                 void* stream) {
  if (n < 0 || d <= 0 || num_rows < 0) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const int lanes = distemb::lanes_per_row(d);
  distemb::gather_checked_kernel<<<distemb::blocks_for(n * lanes), distemb::kThreads, 0,
                                   distemb::as_stream(stream)>>>(
      table, num_rows, d, rows, n, lanes, out, reinterpret_cast<long long*>(flags));
  return cudaGetLastError();
}
