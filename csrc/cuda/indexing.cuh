// Sizes and thread indexing shared by the kernels; internal, not part of the C API.
// Free of the CUDA runtime's host API, so tests/cuda_host/ can compile the kernels that
// use it as plain C++ (tests/test_cuda_emulated.py).
#ifndef DISTEMB_CUDA_INDEXING_CUH_
#define DISTEMB_CUDA_INDEXING_CUH_

#include <cstdint>

namespace distemb {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
// Rows per chunk of the segment sum (dedup.cu): a run of an id's rows is summed in chunks
// of this many, in parallel, then the chunks' sums in chunk order. Exported through
// distemb_cuda_sum_chunk_rows so that the tests' CPU twin sums in the same order.
constexpr int kSumChunk = 32;
// Grid-stride loops cover any size; more blocks than this only adds scheduling cost.
constexpr int64_t kMaxBlocks = 1 << 16;

inline unsigned blocks_for(int64_t threads_needed) {
  int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// Rows are spread over groups of `lanes` threads (a power of two up to a warp, see
// lanes_per_row), one group per row at a time, its lanes striding over the columns.
// This avoids a 64-bit division per element and keeps narrow rows from idling a warp.
inline int lanes_per_row(int64_t d) {
  int lanes = 1;
  while (lanes < d && lanes < kWarp) lanes *= 2;
  return lanes;
}

__device__ inline int64_t first_row(int lanes) {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / lanes) + threadIdx.x / lanes;
}

__device__ inline int64_t row_stride(int lanes) {
  return static_cast<int64_t>(gridDim.x) * (blockDim.x / lanes);
}

// The state arrays of an element-wise rule (csrc/rules.h), passed to a kernel by value.
template <int K>
struct StatePtrs {
  float* p[K > 0 ? K : 1];
};

__device__ inline int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ inline int64_t thread_count() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace distemb

#endif  // DISTEMB_CUDA_INDEXING_CUH_
