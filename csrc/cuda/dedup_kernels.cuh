// The kernels of the segment sum (dedup.cu), in batch and chunk order; internal.
// Only thread indexing is used here (no CUDA runtime calls, no warp intrinsics), so
// tests/cuda_host/ compiles these same kernels as plain C++ and runs them thread by
// thread against the CPU twin (tests/test_cuda_emulated.py).
#ifndef DISTEMB_CUDA_DEDUP_KERNELS_CUH_
#define DISTEMB_CUDA_DEDUP_KERNELS_CUH_

#include <cstdint>

#include "indexing.cuh"

namespace distemb {
namespace {

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

#endif  // DISTEMB_CUDA_DEDUP_KERNELS_CUH_
