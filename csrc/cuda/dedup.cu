// Dedup + coalesce: ascending unique ids and the sum of the gradient rows of each,
// balanced under skew and deterministic (the pattern of PyTorch's
// EmbeddingBackwardKernel.cu and FBGEMM's TBE backward).
//
// 1. A stable radix sort of (id, position) pairs keeps each id's rows in batch order;
//    run-length encoding gives each unique id's run of sorted positions.
// 2. Every run is cut into chunks of kSumChunk rows (the last one shorter). One group of
//    lanes sums one chunk, its rows added one after another in batch order, so a hot id
//    with thousands of rows is summed by hundreds of groups at once instead of one.
// 3. A run of one chunk writes its sum straight to the output. A longer run writes one
//    partial sum per chunk, and a combine pass adds them in chunk order.
// The order of every addition is fixed by the ids alone, never by scheduling: results
// are identical run to run (tests/cpu_cuda_twin.py reproduces it bit for bit). The
// unique count stays on the device: every kernel after the sort reads it there, so the
// whole dedup is enqueued without the host waiting in between, and with the table size
// given, unused unique-id slots say "outside the table", so an update can consume all n
// slots and the host need never learn the count.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include <climits>

#include "common.cuh"

namespace distemb {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// A run of c rows has ceil(c / kSumChunk) chunks; only runs of more than kSumChunk rows
// have partial sums, fewer than 2 c / kSumChunk of them, so 2 n / kSumChunk + 1 partial
// rows always suffice.
int64_t max_partials(int64_t n) { return 2 * n / kSumChunk + 1; }

// Where each array lives in the caller's workspace, for a batch of n ids of width d.
struct Layout {
  size_t keys, sorted_ids, pos_in, pos_sorted, counts, offsets, chunks, chunk_end, multi,
      partial_start, chunk_run, num_unique, partials, cub_temp;

  Layout(int64_t n, int64_t d) {
    const size_t ids = align_up(n * sizeof(int64_t)), ints = align_up(n * sizeof(int32_t));
    keys = 0;                            // the ids, those outside the table made num_rows
    sorted_ids = keys + ids;
    pos_in = sorted_ids + ids;
    pos_sorted = pos_in + ints;
    counts = pos_sorted + ints;          // rows of run k (0 past the last run)
    offsets = counts + ints;             // first sorted position of run k
    chunks = offsets + ints;             // chunks of run k
    chunk_end = chunks + ints;           // inclusive scan of chunks: run k's chunks end here
    multi = chunk_end + ints;            // chunks of run k if more than one, else 0
    partial_start = multi + ints;        // exclusive scan of multi: run k's first partial row
    chunk_run = partial_start + ints;    // the run of chunk c
    num_unique = chunk_run + ints;       // one int64
    partials = num_unique + kAlign;      // (max_partials(n), d) floats
    cub_temp = partials + align_up(max_partials(n) * d * sizeof(float));
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

// CUB's scratch need for the passes of dedup_sort; they run one after another on one
// stream, so they share one buffer.
cudaError_t cub_temp_bytes(int n, int end_bit, size_t* bytes) {
  size_t sort = 0, encode = 0, scan = 0, inclusive = 0;
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
  DISTEMB_TRY(cub::DeviceScan::InclusiveSum(nullptr, inclusive, static_cast<int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), n));
  size_t most = sort;
  for (size_t b : {encode, scan, inclusive}) most = b > most ? b : most;
  *bytes = most;
  return cudaSuccess;
}

cudaError_t workspace_bytes(int64_t n, int64_t d, int end_bit, size_t* bytes) {
  size_t cub_bytes = 0;
  DISTEMB_TRY(cub_temp_bytes(static_cast<int>(n), end_bit, &cub_bytes));
  *bytes = Layout(n, d).cub_temp + align_up(cub_bytes);
  return cudaSuccess;
}

// Positions are int32 (half the sort traffic of int64), hence the cap on n.
bool bad_batch(int64_t n) { return n < 0 || n > INT_MAX; }

bool bad_end_bit(int end_bit) { return end_bit < 1 || end_bit > 64; }

__global__ void iota_kernel(int32_t* out, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = static_cast<int32_t>(i);
}

// Sort keys: every id outside [0, num_rows) becomes num_rows, so bad ids (validated on the
// device, reported later) form one run past the table that the updates skip, instead of
// aliasing valid ids in a sort that reads only the table's bits.
__global__ void keys_kernel(const int64_t* ids, int64_t n, int64_t num_rows, int64_t* keys) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t id = ids[i];
    keys[i] = id < 0 || id >= num_rows ? num_rows : id;
  }
}

// Unique-id slots past the unique count get `fill` (the table size: outside the table),
// so a caller may hand all n slots to an update without knowing the count on the host.
__global__ void pad_kernel(int64_t* uniq, int64_t n, const int64_t* num_unique, int64_t fill) {
  for (int64_t i = *num_unique + thread_index(); i < n; i += thread_count()) uniq[i] = fill;
}

// Chunks of every run (0 for the empty runs past the last one).
__global__ void plan_kernel(const int32_t* counts, int64_t n, int32_t* chunks, int32_t* multi) {
  for (int64_t k = thread_index(); k < n; k += thread_count()) {
    const int32_t q = (counts[k] + kSumChunk - 1) / kSumChunk;
    chunks[k] = q;
    multi[k] = q > 1 ? q : 0;
  }
}

// chunk_run[c] = k for every chunk c of run k; a warp per run, its lanes striding over
// the run's chunks, so a hot run costs a few stores per lane.
__global__ void chunk_run_kernel(const int32_t* chunks, const int32_t* chunk_end,
                                 const int64_t* num_unique, int32_t* chunk_run) {
  const int64_t u = *num_unique;
  const int lane = threadIdx.x % kWarp;
  for (int64_t k = first_row(kWarp); k < u; k += row_stride(kWarp)) {
    const int32_t q = chunks[k], first = chunk_end[k] - q;
    for (int32_t j = lane; j < q; j += kWarp) chunk_run[first + j] = static_cast<int32_t>(k);
  }
}

// Loads are issued this many rows at a time, for kCols columns of each, so a lane keeps
// kBatchLoads * kCols loads in flight instead of waiting on each row in turn; the
// additions that follow stay in row order for every column.
constexpr int kBatchLoads = 8;
constexpr int kCols = 4;

// dst[col] = rows[0][col] + rows[1][col] + ... + rows[len-1][col], added in that order,
// for the columns col0, col0 + lanes, ... (kCols of them, those < d), where row r is
// src + row_offset(r) (a multiple of d).
template <typename RowOffset>
__device__ inline void sum_rows(const float* __restrict__ src, int64_t d, int32_t len,
                                RowOffset row_offset, int64_t col0, int lanes, float* dst) {
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t col = col0 + c * lanes;
    acc[c] = col < d ? src[row_offset(0) + col] : 0.0f;
  }
  int32_t q = 1;
  for (; q + kBatchLoads <= len; q += kBatchLoads) {
    float v[kBatchLoads][kCols];
#pragma unroll
    for (int u = 0; u < kBatchLoads; ++u) {
      const int64_t base = row_offset(q + u);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int64_t col = col0 + c * lanes;
        v[u][c] = col < d ? src[base + col] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatchLoads; ++u) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] += v[u][c];
    }
  }
  for (; q < len; ++q) {
    const int64_t base = row_offset(q);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int64_t col = col0 + c * lanes;
      if (col < d) acc[c] += src[base + col];
    }
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t col = col0 + c * lanes;
    if (col < d) dst[col] = acc[c];
  }
}

// One group of lanes per chunk; the chunk count is the last inclusive-scan entry.
__global__ void chunk_sum_kernel(const float* __restrict__ grads, int64_t d, int64_t n,
                                 const int32_t* __restrict__ pos_sorted, const int32_t* counts,
                                 const int32_t* offsets, const int32_t* chunks,
                                 const int32_t* chunk_end, const int32_t* partial_start,
                                 const int32_t* chunk_run, int lanes, float* summed,
                                 float* partials) {
  const int64_t total = chunk_end[n - 1];
  const int lane = threadIdx.x % lanes;
  for (int64_t c = first_row(lanes); c < total; c += row_stride(lanes)) {
    const int32_t k = chunk_run[c], q = chunks[k];
    const int32_t j = static_cast<int32_t>(c) - (chunk_end[k] - q);
    const int32_t skip = j * kSumChunk, rest = counts[k] - skip;
    const int32_t len = rest < kSumChunk ? rest : kSumChunk;
    const int32_t* pos = pos_sorted + offsets[k] + skip;
    float* dst = q == 1 ? summed + static_cast<int64_t>(k) * d
                        : partials + static_cast<int64_t>(partial_start[k] + j) * d;
    const auto row = [pos, d](int32_t r) { return static_cast<int64_t>(pos[r]) * d; };
    for (int64_t col0 = lane; col0 < d; col0 += kCols * lanes) {
      sum_rows(grads, d, len, row, col0, lanes, dst);
    }
  }
}

// One group of lanes per run of several chunks: its partial sums added in chunk order.
__global__ void combine_kernel(int64_t d, const int64_t* num_unique, const int32_t* chunks,
                               const int32_t* partial_start, const float* __restrict__ partials,
                               int lanes, float* summed) {
  const int64_t u = *num_unique;
  const int lane = threadIdx.x % lanes;
  for (int64_t k = first_row(lanes); k < u; k += row_stride(lanes)) {
    const int32_t q = chunks[k];
    if (q < 2) continue;
    const float* p = partials + static_cast<int64_t>(partial_start[k]) * d;
    const auto row = [d](int32_t r) { return static_cast<int64_t>(r) * d; };
    for (int64_t col0 = lane; col0 < d; col0 += kCols * lanes) {
      sum_rows(p, d, q, row, col0, lanes, summed + k * d);
    }
  }
}

}  // namespace
}  // namespace distemb

DISTEMB_API int distemb_cuda_sum_chunk_rows(void) { return distemb::kSumChunk; }

DISTEMB_API int distemb_cuda_dedup_workspace_bytes(int64_t n, int64_t d, int end_bit,
                                                   size_t* bytes_host, int device) {
  if (distemb::bad_batch(n) || d < 0 || distemb::bad_end_bit(end_bit) || bytes_host == nullptr) {
    return cudaErrorInvalidValue;
  }
  DISTEMB_TRY(cudaSetDevice(device));
  return distemb::workspace_bytes(n, d, end_bit, bytes_host);
}

DISTEMB_API int distemb_cuda_dedup_sort(const int64_t* ids, int64_t n, int64_t d,
                                        int64_t num_rows, int end_bit, void* workspace,
                                        size_t workspace_bytes, int64_t* uniq,
                                        int64_t* num_unique, int device, void* stream) {
  if (distemb::bad_batch(n) || d < 0 || distemb::bad_end_bit(end_bit) ||
      (num_rows > 0 && end_bit < 64 && (num_rows >> end_bit) != 0)) {
    return cudaErrorInvalidValue;  // num_rows itself (the key of bad ids) must fit
  }
  DISTEMB_TRY(cudaSetDevice(device));
  size_t needed = 0;
  DISTEMB_TRY(distemb::workspace_bytes(n, d, end_bit, &needed));
  if (workspace_bytes < needed) return cudaErrorInvalidValue;
  const cudaStream_t s = distemb::as_stream(stream);
  if (n == 0) return cudaMemsetAsync(num_unique, 0, sizeof(int64_t), s);

  const distemb::Layout lay(n, d);
  int64_t* keys = distemb::at<int64_t>(workspace, lay.keys);
  int64_t* sorted_ids = distemb::at<int64_t>(workspace, lay.sorted_ids);
  int32_t* pos_in = distemb::at<int32_t>(workspace, lay.pos_in);
  int32_t* pos_sorted = distemb::at<int32_t>(workspace, lay.pos_sorted);
  int32_t* counts = distemb::at<int32_t>(workspace, lay.counts);
  int32_t* offsets = distemb::at<int32_t>(workspace, lay.offsets);
  int32_t* chunks = distemb::at<int32_t>(workspace, lay.chunks);
  int32_t* chunk_end = distemb::at<int32_t>(workspace, lay.chunk_end);
  int32_t* multi = distemb::at<int32_t>(workspace, lay.multi);
  int32_t* partial_start = distemb::at<int32_t>(workspace, lay.partial_start);
  int32_t* chunk_run = distemb::at<int32_t>(workspace, lay.chunk_run);
  int64_t* unique_here = distemb::at<int64_t>(workspace, lay.num_unique);
  void* temp = distemb::at<char>(workspace, lay.cub_temp);
  size_t temp_bytes = workspace_bytes - lay.cub_temp;
  const int count = static_cast<int>(n);

  distemb::iota_kernel<<<distemb::blocks_for(n), distemb::kThreads, 0, s>>>(pos_in, n);
  DISTEMB_TRY(cudaGetLastError());
  const int64_t* sort_keys = ids;
  if (num_rows > 0) {
    distemb::keys_kernel<<<distemb::blocks_for(n), distemb::kThreads, 0, s>>>(ids, n, num_rows,
                                                                            keys);
    DISTEMB_TRY(cudaGetLastError());
    sort_keys = keys;
  }
  DISTEMB_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, sort_keys, sorted_ids, pos_in,
                                              pos_sorted, count, 0, end_bit, s));
  // Counts past the last run stay 0, so every pass below can run over all n entries
  // (the unique count is not known on the host) and those runs have no chunks.
  DISTEMB_TRY(cudaMemsetAsync(counts, 0, n * sizeof(int32_t), s));
  DISTEMB_TRY(cub::DeviceRunLengthEncode::Encode(temp, temp_bytes, sorted_ids, uniq, counts,
                                                 unique_here, count, s));
  DISTEMB_TRY(cudaMemcpyAsync(num_unique, unique_here, sizeof(int64_t),
                              cudaMemcpyDeviceToDevice, s));
  if (num_rows > 0) {
    distemb::pad_kernel<<<distemb::blocks_for(n), distemb::kThreads, 0, s>>>(uniq, n,
                                                                           unique_here,
                                                                           num_rows);
    DISTEMB_TRY(cudaGetLastError());
  }
  DISTEMB_TRY(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, count, s));
  distemb::plan_kernel<<<distemb::blocks_for(n), distemb::kThreads, 0, s>>>(counts, n, chunks,
                                                                          multi);
  DISTEMB_TRY(cudaGetLastError());
  DISTEMB_TRY(cub::DeviceScan::InclusiveSum(temp, temp_bytes, chunks, chunk_end, count, s));
  DISTEMB_TRY(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, multi, partial_start, count, s));
  distemb::chunk_run_kernel<<<distemb::blocks_for(n * distemb::kWarp), distemb::kThreads, 0,
                              s>>>(chunks, chunk_end, unique_here, chunk_run);
  return cudaGetLastError();
}

DISTEMB_API int distemb_cuda_dedup_sum(const float* grads, int64_t n, int64_t d,
                                       void* workspace, size_t workspace_bytes, float* summed,
                                       int device, void* stream) {
  if (distemb::bad_batch(n) || d <= 0) return cudaErrorInvalidValue;
  const distemb::Layout lay(n, d);
  if (workspace_bytes < lay.cub_temp) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const cudaStream_t s = distemb::as_stream(stream);
  const int lanes = distemb::lanes_per_row(d);
  float* partials = distemb::at<float>(workspace, lay.partials);
  const int32_t* chunks = distemb::at<int32_t>(workspace, lay.chunks);
  const int32_t* partial_start = distemb::at<int32_t>(workspace, lay.partial_start);
  // Grids are sized for the most chunks (n) and runs (n) a batch can have; the groups
  // past the counts on the device return at once.
  distemb::chunk_sum_kernel<<<distemb::blocks_for(n * lanes), distemb::kThreads, 0, s>>>(
      grads, d, n, distemb::at<int32_t>(workspace, lay.pos_sorted),
      distemb::at<int32_t>(workspace, lay.counts), distemb::at<int32_t>(workspace, lay.offsets),
      chunks, distemb::at<int32_t>(workspace, lay.chunk_end), partial_start,
      distemb::at<int32_t>(workspace, lay.chunk_run), lanes, summed, partials);
  DISTEMB_TRY(cudaGetLastError());
  distemb::combine_kernel<<<distemb::blocks_for(n * lanes), distemb::kThreads, 0, s>>>(
      d, distemb::at<int64_t>(workspace, lay.num_unique), chunks, partial_start, partials,
      lanes, summed);
  return cudaGetLastError();
}
