// Entry points of the half-precision row kernels (half_kernels.cuh). `kind` picks the
// storage format once per call: 0 bfloat16, 1 float16, 2 bfloat16 rounded stochastically
// from `seed` (the updates only; the gather reads it as bfloat16).
#include "common.cuh"
#include "half_kernels.cuh"

namespace {

bool bad_args(int kind, int64_t num_rows, int64_t d, int64_t n) {
  return kind < 0 || kind > 2 || num_rows < 0 || n < 0 || d <= 0;
}

// Launch `kernel<Conv>` for the format `kind`.
#define DISTEMB_HALF_LAUNCH(kernel, blocks, ...)                                          \
  do {                                                                                    \
    const unsigned distemb_blocks_ = (blocks);                                            \
    cudaStream_t distemb_stream_ = distemb::as_stream(stream);                            \
    if (kind == distemb::half::kBF16) {                                                   \
      kernel<distemb::half::BF16>                                                         \
          <<<distemb_blocks_, distemb::kThreads, 0, distemb_stream_>>>(__VA_ARGS__);      \
    } else if (kind == distemb::half::kF16) {                                             \
      kernel<distemb::half::F16>                                                          \
          <<<distemb_blocks_, distemb::kThreads, 0, distemb_stream_>>>(__VA_ARGS__);      \
    } else {                                                                              \
      kernel<distemb::half::BF16SR>                                                       \
          <<<distemb_blocks_, distemb::kThreads, 0, distemb_stream_>>>(__VA_ARGS__);      \
    }                                                                                     \
  } while (0)

// The body of every generated element-wise entry point, after its argument checks.
template <class R>
int launch_half_elementwise(uint16_t* weight, int kind, uint64_t seed,
                            distemb::StatePtrs<R::kStates> states, int64_t num_rows, int64_t d,
                            const int64_t* rows, const float* grads, int64_t n,
                            typename R::Params p, int device, void* stream) {
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const int lanes = distemb::lanes_per_row(d);
#define DISTEMB_ELEMENTWISE_KERNEL(Conv) distemb::half::elementwise_kernel<Conv, R>
  if (kind == distemb::half::kBF16) {
    DISTEMB_ELEMENTWISE_KERNEL(distemb::half::BF16)
        <<<distemb::blocks_for(n * lanes), distemb::kThreads, 0, distemb::as_stream(stream)>>>(
            weight, states, num_rows, d, rows, grads, n, lanes, p, seed);
  } else if (kind == distemb::half::kF16) {
    DISTEMB_ELEMENTWISE_KERNEL(distemb::half::F16)
        <<<distemb::blocks_for(n * lanes), distemb::kThreads, 0, distemb::as_stream(stream)>>>(
            weight, states, num_rows, d, rows, grads, n, lanes, p, seed);
  } else {
    DISTEMB_ELEMENTWISE_KERNEL(distemb::half::BF16SR)
        <<<distemb::blocks_for(n * lanes), distemb::kThreads, 0, distemb::as_stream(stream)>>>(
            weight, states, num_rows, d, rows, grads, n, lanes, p, seed);
  }
#undef DISTEMB_ELEMENTWISE_KERNEL
  return cudaGetLastError();
}

}  // namespace

using distemb::blocks_for;
using distemb::kWarp;
using distemb::lanes_per_row;

DISTEMB_API int distemb_cuda_half_gather_rows_checked(const uint16_t* table, int kind,
                                                      int64_t num_rows, int64_t d,
                                                      const int64_t* rows, int64_t n,
                                                      float* out, int64_t* flags,
                                                      int device, void* stream) {
  if (bad_args(kind, num_rows, d, n)) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const int lanes = lanes_per_row(d);
  DISTEMB_HALF_LAUNCH(distemb::half::gather_checked_kernel, blocks_for(n * lanes), table,
                      num_rows, d, rows, n, lanes, out, reinterpret_cast<long long*>(flags));
  return cudaGetLastError();
}

DISTEMB_API int distemb_cuda_half_rowwise_adagrad_update(uint16_t* weight, int kind,
                                                         uint64_t seed, float* state_sum,
                                                         int64_t num_rows, int64_t d,
                                                         const int64_t* rows,
                                                         const float* grads, int64_t n,
                                                         float clr, float eps, int device,
                                                         void* stream) {
  if (bad_args(kind, num_rows, d, n)) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  DISTEMB_HALF_LAUNCH(distemb::half::rowwise_adagrad_kernel, blocks_for(n * kWarp), weight,
                      state_sum, num_rows, d, rows, grads, n, clr, eps, seed);
  return cudaGetLastError();
}

DISTEMB_API int distemb_cuda_half_adam_update(uint16_t* weight, int kind, uint64_t seed,
                                              float* exp_avg, float* exp_avg_sq,
                                              int64_t num_rows, int64_t d, const int64_t* rows,
                                              const float* grads, int64_t n, double lr,
                                              double beta1, double beta2, double eps,
                                              int64_t step, int64_t* row_steps, int device,
                                              void* stream) {
  if (bad_args(kind, num_rows, d, n) || (row_steps == nullptr && step < 1)) {
    return cudaErrorInvalidValue;
  }
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const float global_step_size =
      row_steps == nullptr
          ? distemb::rules::adam_step_size(lr, beta1, beta2, static_cast<double>(step))
          : 0.0f;
  DISTEMB_HALF_LAUNCH(distemb::half::adam_kernel, blocks_for(n * kWarp), weight, exp_avg,
                      exp_avg_sq, num_rows, d, rows, grads, n, lr, beta1, beta2,
                      static_cast<float>(eps), global_step_size, row_steps, seed);
  return cudaGetLastError();
}

// The entry points of the element-wise rules, generated from distemb/kernels/rule_table.py.
#include "../gen/cuda_half_rules.inc"
