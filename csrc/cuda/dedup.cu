// Dedup + coalesce: ascending unique ids and the sum of the gradient rows of each.
// A stable radix sort of (id, position) pairs keeps each id's rows in batch order, and
// each sum adds them in that order, as the CPU kernels do: results are deterministic.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include <climits>

#include "common.cuh"

namespace distemb {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Where each array lives in the caller's workspace, for a batch of n ids.
struct Layout {
  size_t sorted_ids, pos_in, pos_sorted, counts, offsets, cub_temp;

  explicit Layout(int64_t n) {
    const size_t ids = align_up(n * sizeof(int64_t)), ints = align_up(n * sizeof(int32_t));
    sorted_ids = 0;
    pos_in = sorted_ids + ids;
    pos_sorted = pos_in + ints;
    counts = pos_sorted + ints;
    offsets = counts + ints;
    cub_temp = offsets + ints;
  }
};

template <typename T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

template <typename T>
const T* at(const void* base, size_t offset) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + offset);
}

// CUB's scratch need for the three passes of dedup_sort; they run one after another,
// so they share one buffer.
cudaError_t cub_temp_bytes(int n, int end_bit, size_t* bytes) {
  size_t sort = 0, encode = 0, scan = 0;
  DISTEMB_TRY(cub::DeviceRadixSort::SortPairs(nullptr, sort, static_cast<const int64_t*>(nullptr),
                                              static_cast<int64_t*>(nullptr),
                                              static_cast<const int32_t*>(nullptr),
                                              static_cast<int32_t*>(nullptr), n, 0, end_bit));
  DISTEMB_TRY(cub::DeviceRunLengthEncode::Encode(nullptr, encode,
                                                 static_cast<const int64_t*>(nullptr),
                                                 static_cast<int64_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr),
                                                 static_cast<int64_t*>(nullptr), n));
  DISTEMB_TRY(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), n));
  *bytes = sort > encode ? sort : encode;
  *bytes = *bytes > scan ? *bytes : scan;
  return cudaSuccess;
}

cudaError_t workspace_bytes(int64_t n, int end_bit, size_t* bytes) {
  size_t cub_bytes = 0;
  DISTEMB_TRY(cub_temp_bytes(static_cast<int>(n), end_bit, &cub_bytes));
  *bytes = Layout(n).cub_temp + align_up(cub_bytes);
  return cudaSuccess;
}

// Positions are int32 (half the sort traffic of int64), hence the cap on n.
bool bad_batch(int64_t n) { return n < 0 || n > INT_MAX; }

bool bad_end_bit(int end_bit) { return end_bit < 1 || end_bit > 64; }

__global__ void iota_kernel(int32_t* out, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = static_cast<int32_t>(i);
}

// Rows of one id are loaded this many at a time: a zipf head id can have thousands of
// rows, and loading them one by one would leave its thread waiting on memory.
constexpr int kBatchLoads = 16;

// One group of lanes per unique id, each lane summing its columns over the id's rows in
// batch order (loads are batched, the additions stay sequential).
__global__ void segment_sum_kernel(const float* __restrict__ grads, int64_t d,
                                   const int32_t* __restrict__ pos_sorted,
                                   const int32_t* counts, const int32_t* offsets,
                                   int64_t num_unique, int lanes, float* summed) {
  const int lane = threadIdx.x % lanes;
  for (int64_t k = first_row(lanes); k < num_unique; k += row_stride(lanes)) {
    const int32_t* pos = pos_sorted + offsets[k];
    const int32_t count = counts[k];
    for (int64_t j = lane; j < d; j += lanes) {
      float acc = grads[pos[0] * d + j];
      int32_t q = 1;
      for (; q + kBatchLoads <= count; q += kBatchLoads) {
        float v[kBatchLoads];
#pragma unroll
        for (int u = 0; u < kBatchLoads; ++u) v[u] = grads[pos[q + u] * d + j];
#pragma unroll
        for (int u = 0; u < kBatchLoads; ++u) acc += v[u];
      }
      for (; q < count; ++q) acc += grads[pos[q] * d + j];
      summed[k * d + j] = acc;
    }
  }
}

}  // namespace
}  // namespace distemb

DISTEMB_API int distemb_cuda_dedup_workspace_bytes(int64_t n, int end_bit, size_t* bytes_host,
                                                   int device) {
  if (distemb::bad_batch(n) || distemb::bad_end_bit(end_bit) || bytes_host == nullptr) {
    return cudaErrorInvalidValue;
  }
  DISTEMB_TRY(cudaSetDevice(device));
  return distemb::workspace_bytes(n, end_bit, bytes_host);
}

DISTEMB_API int distemb_cuda_dedup_sort(const int64_t* ids, int64_t n, int end_bit,
                                        void* workspace, size_t workspace_bytes, int64_t* uniq,
                                        int64_t* num_unique, int device, void* stream) {
  if (distemb::bad_batch(n) || distemb::bad_end_bit(end_bit)) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  size_t needed = 0;
  DISTEMB_TRY(distemb::workspace_bytes(n, end_bit, &needed));
  if (workspace_bytes < needed) return cudaErrorInvalidValue;
  const cudaStream_t s = distemb::as_stream(stream);
  if (n == 0) return cudaMemsetAsync(num_unique, 0, sizeof(int64_t), s);

  const distemb::Layout lay(n);
  int64_t* sorted_ids = distemb::at<int64_t>(workspace, lay.sorted_ids);
  int32_t* pos_in = distemb::at<int32_t>(workspace, lay.pos_in);
  int32_t* pos_sorted = distemb::at<int32_t>(workspace, lay.pos_sorted);
  int32_t* counts = distemb::at<int32_t>(workspace, lay.counts);
  int32_t* offsets = distemb::at<int32_t>(workspace, lay.offsets);
  void* temp = distemb::at<char>(workspace, lay.cub_temp);
  size_t temp_bytes = workspace_bytes - lay.cub_temp;
  const int count = static_cast<int>(n);

  distemb::iota_kernel<<<distemb::blocks_for(n), distemb::kThreads, 0, s>>>(pos_in, n);
  DISTEMB_TRY(cudaGetLastError());
  DISTEMB_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted_ids, pos_in,
                                              pos_sorted, count, 0, end_bit, s));
  // Counts past the last run stay 0, so scanning all n of them (the unique count is
  // not known on the host) yields correct offsets for the runs.
  DISTEMB_TRY(cudaMemsetAsync(counts, 0, n * sizeof(int32_t), s));
  DISTEMB_TRY(cub::DeviceRunLengthEncode::Encode(temp, temp_bytes, sorted_ids, uniq, counts,
                                                 num_unique, count, s));
  return cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, count, s);
}

DISTEMB_API int distemb_cuda_dedup_sum(const float* grads, int64_t n, int64_t d,
                                       const void* workspace, size_t workspace_bytes,
                                       int64_t num_unique, float* summed, int device,
                                       void* stream) {
  const distemb::Layout lay(n);
  if (distemb::bad_batch(n) || d <= 0 || num_unique < 0 || num_unique > n ||
      workspace_bytes < lay.cub_temp) {
    return cudaErrorInvalidValue;
  }
  DISTEMB_TRY(cudaSetDevice(device));
  if (num_unique == 0) return cudaSuccess;
  const int lanes = distemb::lanes_per_row(d);
  distemb::segment_sum_kernel<<<distemb::blocks_for(num_unique * lanes), distemb::kThreads, 0,
                                distemb::as_stream(stream)>>>(
      grads, d, distemb::at<int32_t>(workspace, lay.pos_sorted),
      distemb::at<int32_t>(workspace, lay.counts), distemb::at<int32_t>(workspace, lay.offsets),
      num_unique, lanes, summed);
  return cudaGetLastError();
}
