// Runs the half-precision row kernels (csrc/cuda/half_kernels.cuh) on the CPU, thread by
// thread, as emulate_gather.cpp does for the float32 gather: atomics become plain
// updates and __syncwarp a no-op (the emulated threads run one at a time, a warp's lanes
// in order, so the last lane writes a row's shared value after the others read it).
//
// Usage: emulate_half IN OUT. IN: int64 op (0 gather_checked, 1 sgd, 2 adagrad,
// 3 rowwise_adagrad, 4 adam, 5 ftrl, 100 + k the k-th element-wise rule of the table, its
// hyperparameters in the lr, eps, beta1, beta2 slots and the two more that ftrl reads,
// its states A and B), kind, num_rows, d, n, seed, step, has_row_steps;
// float64 lr, eps, beta1, beta2; uint16 table bits (num_rows*d); int64 flags (3); int64
// ids (n); float32 grads (n*d); float32 state A and B (num_rows*d each; rowwise uses the
// first num_rows of A); int64 row_steps (num_rows); for ftrl only, two more float64,
// l2_shrinkage and beta (ftrl reads lr_power, l1, l2 from the eps, beta1, beta2 slots).
// OUT: the table bits, flags, the gathered rows (n*d float32), states A and B,
// row_steps, in that order and format. `emulate_half --rules` lists the element-wise
// rules it runs (csrc/gen/rule_list.h, generated from distemb/kernels/rule_table.py).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__

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
void __syncwarp() {}

#include "../../csrc/cuda/half_kernels.cuh"
#include "../../csrc/gen/rule_list.h"  // generated from distemb/kernels/rule_table.py

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

template <typename T>
void write(std::FILE* f, const std::vector<T>& v) {
  if (!v.empty() && std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) std::exit(4);
}

// The element-wise rules, in table order (DISTEMB_ELEMENTWISE_RULES).
#define DISTEMB_RULE_NAME(name, Struct) #name,
const char* const kElementwise[] = {DISTEMB_ELEMENTWISE_RULES(DISTEMB_RULE_NAME)};
#undef DISTEMB_RULE_NAME
constexpr int64_t kRuleOps = 100;  // op 100 + k: element-wise rule k of the table

// Everything one run needs; `run<Conv>` launches the op as half.cu would.
struct Job {
  int64_t op, kind, num_rows, d, n, step;
  uint64_t seed;
  bool has_row_steps;
  double lr, eps, beta1, beta2, l2_shrinkage, beta;
  std::vector<uint16_t> table;
  std::vector<long long> flags;
  std::vector<int64_t> ids, row_steps;
  std::vector<float> grads, a, b, out;
};

// Element-wise rule R with hyperparameters h (table order) and states a, b.
template <class C, class R>
void run_elementwise(Job& j, const double* h) {
  using namespace distemb;
  const int lanes = lanes_per_row(j.d);
  StatePtrs<R::kStates> s{};
  float* arrays[2] = {j.a.data(), j.b.data()};
  for (int k = 0; k < R::kStates && k < 2; ++k) s.p[k] = arrays[k];
  emulate(blocks_for(j.n * lanes), kThreads, half::elementwise_kernel<C, R>, j.table.data(), s,
          j.num_rows, j.d, j.ids.data(), j.grads.data(), j.n, lanes, R::params(h), j.seed);
}

// The element-wise rule of op: 1 sgd, 2 adagrad, 5 ftrl (the tests' first numbers), or
// 100 + its index in the table; nullptr for the others.
const char* elementwise_rule(int64_t op) {
  if (op == 1) return "sgd";
  if (op == 2) return "adagrad";
  if (op == 5) return "ftrl";
  const int64_t count = sizeof(kElementwise) / sizeof(kElementwise[0]);
  return op >= kRuleOps && op < kRuleOps + count ? kElementwise[op - kRuleOps] : nullptr;
}

template <class C>
void run(Job& j) {
  using namespace distemb;
  const int lanes = lanes_per_row(j.d);
  int64_t* steps = j.has_row_steps ? j.row_steps.data() : nullptr;
  if (const char* rule = elementwise_rule(j.op)) {
    // hyperparameters in table order: lr, then the eps, beta1, beta2 slots, then two more
    const double h[] = {j.lr, j.eps, j.beta1, j.beta2, j.l2_shrinkage, j.beta};
#define DISTEMB_RUN_RULE(name, Struct) \
    if (std::strcmp(rule, #name) == 0) return run_elementwise<C, rules::Struct>(j, h);
    DISTEMB_ELEMENTWISE_RULES(DISTEMB_RUN_RULE)
#undef DISTEMB_RUN_RULE
  }
  switch (j.op) {
    case 0:
      emulate(blocks_for(j.n * lanes), kThreads, half::gather_checked_kernel<C>, j.table.data(),
              j.num_rows, j.d, j.ids.data(), j.n, lanes, j.out.data(), j.flags.data());
      break;
    case 3:
      emulate(blocks_for(j.n * kWarp), kThreads, half::rowwise_adagrad_kernel<C>,
              j.table.data(), j.a.data(), j.num_rows, j.d, j.ids.data(), j.grads.data(), j.n,
              static_cast<float>(j.lr), static_cast<float>(j.eps), j.seed);
      break;
    default: {
      const float global = steps == nullptr
          ? rules::adam_step_size(j.lr, j.beta1, j.beta2, static_cast<double>(j.step)) : 0.0f;
      emulate(blocks_for(j.n * kWarp), kThreads, half::adam_kernel<C>, j.table.data(),
              j.a.data(), j.b.data(), j.num_rows, j.d, j.ids.data(), j.grads.data(), j.n, j.lr,
              j.beta1, j.beta2, static_cast<float>(j.eps), global, steps, j.seed);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--rules") == 0) {  // the element-wise rules it runs
    for (const char* name : kElementwise) std::printf("%s\n", name);
    return 0;
  }
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  const std::vector<int64_t> head = read<int64_t>(in, 8);
  const std::vector<double> hyper = read<double>(in, 4);
  Job j{head[0], head[1], head[2], head[3], head[4], head[6], static_cast<uint64_t>(head[5]),
        head[7] != 0, hyper[0], hyper[1], hyper[2], hyper[3], 0.0, 0.0};
  const size_t cells = static_cast<size_t>(j.num_rows * j.d);
  j.table = read<uint16_t>(in, cells);
  j.flags = read<long long>(in, 3);
  j.ids = read<int64_t>(in, j.n);
  j.grads = read<float>(in, j.n * j.d);
  j.a = read<float>(in, cells);
  j.b = read<float>(in, cells);
  j.row_steps = read<int64_t>(in, j.num_rows);
  if (j.op == 5 || j.op >= kRuleOps) {
    const std::vector<double> more = read<double>(in, 2);
    j.l2_shrinkage = more[0];
    j.beta = more[1];
  }
  std::fclose(in);
  j.out.assign(j.n * j.d, -777.0f);
  if (j.kind == distemb::half::kBF16) run<distemb::half::BF16>(j);
  else if (j.kind == distemb::half::kF16) run<distemb::half::F16>(j);
  else run<distemb::half::BF16SR>(j);
  std::FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 2;
  write(o, j.table);
  write(o, j.flags);
  write(o, j.out);
  write(o, j.a);
  write(o, j.b);
  write(o, j.row_steps);
  std::fclose(o);
  return 0;
}
