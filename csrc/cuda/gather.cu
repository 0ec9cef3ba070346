// Row gather and the library's utility entry points.
#include "common.cuh"
#include "gather_kernels.cuh"

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
