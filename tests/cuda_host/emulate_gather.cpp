// Runs gather_checked_kernel (csrc/cuda/gather_kernels.cuh) on the CPU, thread by thread,
// as emulate_dedup.cpp does for the segment sum; the three atomics are plain updates
// here (the emulated threads run one at a time).
//
// Usage: emulate_gather IN OUT. IN: int64 num_rows, d, n, then three int64 flags, the
// num_rows*d float32 table and n int64 ids. OUT: the three flags, then n*d float32 rows.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __restrict__ __restrict

struct Dim3 {
  unsigned x = 0;
};
Dim3 blockIdx, threadIdx, blockDim, gridDim;

unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  const unsigned long long old = *a;
  *a += v;
  return old;
}
long long atomicMin(long long* a, long long v) {
  const long long old = *a;
  *a = std::min(old, v);
  return old;
}
long long atomicMax(long long* a, long long v) {
  const long long old = *a;
  *a = std::max(old, v);
  return old;
}

#include "../../csrc/cuda/gather_kernels.cuh"

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
  const std::vector<int64_t> head = read<int64_t>(in, 3);
  const int64_t num_rows = head[0], d = head[1], n = head[2];
  std::vector<long long> flags = read<long long>(in, 3);
  const std::vector<float> table = read<float>(in, num_rows * d);
  const std::vector<int64_t> ids = read<int64_t>(in, n);
  std::fclose(in);
  std::vector<float> out(n * d, -777.0f);
  const int lanes = lanes_per_row(d);
  emulate(blocks_for(n * lanes), kThreads, gather_checked_kernel, table.data(), num_rows, d,
          ids.data(), n, lanes, out.data(), flags.data());
  std::FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 2;
  std::fwrite(flags.data(), sizeof(long long), 3, o);
  std::fwrite(out.data(), sizeof(float), n * d, o);
  std::fclose(o);
  return 0;
}
