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
#include "dedup_kernels.cuh"

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
  // Not the whole size again (CUB's queries cost host time every step): the fixed part
  // here, and each CUB pass refuses (cudaErrorInvalidValue) scratch smaller than it needs.
  if (workspace_bytes < distemb::Layout(n, d).cub_temp) return cudaErrorInvalidValue;
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
