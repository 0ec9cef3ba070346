// Runs the segment-sum kernels of csrc/cuda/dedup_kernels.cuh on the CPU, thread by
// thread, so that their indexing and order of additions are tested without a GPU
// (tests/test_cuda_emulated.py compares the result with the CPU twin, bit for bit).
//
// The kernels are compiled as plain C++: __global__/__device__ become nothing, and
// blockIdx/threadIdx/blockDim/gridDim are globals that emulate() sets for each thread
// in turn. That is faithful for these kernels: none of them synchronises, shuffles or
// shares memory between threads; each writes its own outputs. The steps between the
// kernels (CUB's radix sort, run-length encoding and scans in dedup.cu) are done here
// with the standard library, in the same order and on the same buffers.
//
// Usage: emulate_dedup IN OUT. IN: int64 n, d, num_rows (<= 0: none), end_bit, then n
// int64 ids and n*d float32 gradients. OUT: int64 num_unique, n int64 unique ids (the
// slots past num_unique as the kernels leave them), n*d float32 sums.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __restrict__ __restrict

struct Dim3 {
  unsigned x = 0;
};
Dim3 blockIdx, threadIdx, blockDim, gridDim;

#include "../../csrc/cuda/dedup_kernels.cuh"

namespace {

template <typename Kernel, typename... Args>
void emulate(unsigned grid, unsigned block, Kernel kernel, Args... args) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned t = 0; t < block; ++t) {
      threadIdx.x = t;
      kernel(args...);
    }
  }
}

template <typename T>
std::vector<T> read(std::FILE* f, size_t count) {
  std::vector<T> v(count);
  if (count && std::fread(v.data(), sizeof(T), count, f) != count) std::exit(3);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace distemb;
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  const std::vector<int64_t> head = read<int64_t>(in, 4);
  const int64_t n = head[0], d = head[1], num_rows = head[2];
  const int end_bit = static_cast<int>(head[3]);
  const std::vector<int64_t> ids = read<int64_t>(in, n);
  const std::vector<float> grads = read<float>(in, n * d);
  std::fclose(in);

  // dedup_sort
  std::vector<int64_t> keys(ids), sorted_ids(n), uniq(n, -12345);
  std::vector<int32_t> pos_in(n), pos_sorted(n), counts(n, 0), offsets(n), chunks(n),
      chunk_end(n), multi(n), partial_start(n), chunk_run(n, -1);
  std::vector<int64_t> num_unique(1, 0);
  emulate(blocks_for(n), kThreads, iota_kernel, pos_in.data(), n);
  if (num_rows > 0) {
    emulate(blocks_for(n), kThreads, keys_kernel, ids.data(), n, num_rows, keys.data());
  }
  // CUB's radix sort: stable, on bits [0, end_bit) (signed order when all 64 are read).
  const uint64_t mask = end_bit >= 64 ? ~0ull : ((1ull << end_bit) - 1);
  std::vector<int32_t> order(pos_in);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (end_bit >= 64) return keys[a] < keys[b];
    return (static_cast<uint64_t>(keys[a]) & mask) < (static_cast<uint64_t>(keys[b]) & mask);
  });
  for (int64_t i = 0; i < n; ++i) {
    pos_sorted[i] = pos_in[order[i]];
    sorted_ids[i] = keys[order[i]];
  }
  // CUB's run-length encoding, then the scans.
  int64_t u = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || sorted_ids[i] != sorted_ids[i - 1]) uniq[u++] = sorted_ids[i];
    ++counts[u - 1];
  }
  num_unique[0] = u;
  std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), 0);
  if (num_rows > 0) {
    emulate(blocks_for(n), kThreads, pad_kernel, uniq.data(), n,
            static_cast<const int64_t*>(num_unique.data()), num_rows);
  }
  emulate(blocks_for(n), kThreads, plan_kernel, static_cast<const int32_t*>(counts.data()), n,
          chunks.data(), multi.data());
  std::inclusive_scan(chunks.begin(), chunks.end(), chunk_end.begin());
  std::exclusive_scan(multi.begin(), multi.end(), partial_start.begin(), 0);
  emulate(blocks_for(n * kWarp), kThreads, chunk_run_kernel,
          static_cast<const int32_t*>(chunks.data()), static_cast<const int32_t*>(chunk_end.data()),
          static_cast<const int64_t*>(num_unique.data()), chunk_run.data());

  // dedup_sum (partials: the bound dedup.cu allocates, poisoned to show stray reads)
  std::vector<float> summed(n * d, -777.0f), partials((2 * n / kSumChunk + 1) * d, 1e30f);
  if (n > 0 && d > 0) {
    const int lanes = lanes_per_row(d);
    emulate(blocks_for(n * lanes), kThreads, chunk_sum_kernel, grads.data(), d, n,
            static_cast<const int32_t*>(pos_sorted.data()),
            static_cast<const int32_t*>(counts.data()),
            static_cast<const int32_t*>(offsets.data()),
            static_cast<const int32_t*>(chunks.data()),
            static_cast<const int32_t*>(chunk_end.data()),
            static_cast<const int32_t*>(partial_start.data()),
            static_cast<const int32_t*>(chunk_run.data()), lanes, summed.data(),
            partials.data());
    emulate(blocks_for(n * lanes), kThreads, combine_kernel, d,
            static_cast<const int64_t*>(num_unique.data()),
            static_cast<const int32_t*>(chunks.data()),
            static_cast<const int32_t*>(partial_start.data()),
            static_cast<const float*>(partials.data()), lanes, summed.data());
  }

  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  std::fwrite(num_unique.data(), sizeof(int64_t), 1, out);
  std::fwrite(uniq.data(), sizeof(int64_t), n, out);
  std::fwrite(summed.data(), sizeof(float), n * d, out);
  std::fclose(out);
  return 0;
}
