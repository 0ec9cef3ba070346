// Fused sparse optimizer updates, in place on float32 tables, one pass over each row.
// The per-element arithmetic is csrc/rules.h, shared with the CPU kernels; the build
// passes -fmad=false so that no multiply-add is contracted and rounding follows the CPU
// kernels (the rows are memory-bound, the FMA gains nothing). Row-wise Adagrad's mean is
// reduced across a warp, in another order than on the CPU.
#include <cmath>

#include "../rules.h"
#include "common.cuh"

namespace distemb {
namespace {

// Rows are unique, so no two threads touch the same address. A row outside
// [0, num_rows) is skipped, never written: ids are validated on the device without
// stopping the stream (gather_rows_checked), so a bad one may reach an update before the
// host has reported it, and must not write outside the table.
__device__ inline bool out_of_table(int64_t r, int64_t num_rows) {
  return r < 0 || r >= num_rows;
}

// Every element-wise rule R (csrc/rules.h: Sgd, Adagrad, Ftrl, ...): each element is
// R::update of its weight, gradient and the row's R::kStates state arrays. The entry
// points (distemb_cuda_<rule>_update) are generated from distemb/kernels/rule_table.py
// into csrc/gen/cuda_optim_rules.inc, included at the end of this file.
template <class R>
__global__ void elementwise_kernel(float* weight, StatePtrs<R::kStates> states,
                                   int64_t num_rows, int64_t d, const int64_t* rows,
                                   const float* grads, int64_t n, int lanes,
                                   typename R::Params p) {
  const int lane = threadIdx.x % lanes;
  for (int64_t i = first_row(lanes); i < n; i += row_stride(lanes)) {
    if (out_of_table(rows[i], num_rows)) continue;
    const int64_t base = rows[i] * d;
    float* s[R::kStates > 0 ? R::kStates : 1];
    for (int k = 0; k < R::kStates; ++k) s[k] = states.p[k] + base;
    float* w = weight + base;
    const float* g = grads + i * d;
    for (int64_t j = lane; j < d; j += lanes) w[j] = R::update(w[j], g[j], s, j, p);
  }
}

// One warp per row: the row's accumulator needs a reduction over the row first.
__global__ void rowwise_adagrad_kernel(float* weight, float* state_sum, int64_t num_rows,
                                       int64_t d, const int64_t* rows, const float* grads,
                                       int64_t n, float clr, float eps) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t i = first_row(kWarp); i < n; i += row_stride(kWarp)) {
    const int64_t r = rows[i];
    if (out_of_table(r, num_rows)) continue;  // the whole warp: it shares the row
    const float* g = grads + i * d;
    float acc = 0.0f;
    for (int64_t j = lane; j < d; j += kWarp) acc = rules::rowwise_sum_sq(acc, g[j]);
    const float s = rules::rowwise_state(state_sum[r], warp_sum(acc), d);
    __syncwarp();  // every lane has read state_sum[r] before lane 0 overwrites it
    if (lane == 0) state_sum[r] = s;
    const float den = rules::rowwise_denominator(s, eps);
    float* w = weight + r * d;
    for (int64_t j = lane; j < d; j += kWarp) w[j] = rules::rowwise_adagrad(w[j], g[j], clr, den);
  }
}

// One warp per row, so a row's step count is read and bumped once (by lane 0).
__global__ void adam_kernel(float* weight, float* exp_avg, float* exp_avg_sq,
                            int64_t num_rows, int64_t d, const int64_t* rows,
                            const float* grads, int64_t n, double lr, double beta1,
                            double beta2, float eps, float global_step_size,
                            int64_t* row_steps) {
  const int lane = threadIdx.x % kWarp;
  const float omb1 = rules::adam_one_minus(beta1), omb2 = rules::adam_one_minus(beta2);
  for (int64_t i = first_row(kWarp); i < n; i += row_stride(kWarp)) {
    const int64_t r = rows[i];
    if (out_of_table(r, num_rows)) continue;  // the whole warp: it shares the row
    float step_size = global_step_size;
    if (row_steps != nullptr) {
      if (lane == 0) {
        const int64_t st = row_steps[r] + 1;
        row_steps[r] = st;
        step_size = rules::adam_step_size(lr, beta1, beta2, static_cast<double>(st));
      }
      step_size = __shfl_sync(0xffffffffu, step_size, 0);
    }
    const float* g = grads + i * d;
    const int64_t base = r * d;
    for (int64_t j = lane; j < d; j += kWarp) {
      weight[base + j] = rules::adam(weight[base + j], g[j], exp_avg[base + j],
                                     exp_avg_sq[base + j], omb1, omb2, step_size, eps);
    }
  }
}

bool bad_sizes(int64_t num_rows, int64_t d, int64_t n) { return num_rows < 0 || n < 0 || d <= 0; }

// The body of every generated element-wise entry point, after its argument checks.
template <class R>
int launch_elementwise(float* weight, StatePtrs<R::kStates> states, int64_t num_rows,
                       int64_t d, const int64_t* rows, const float* grads, int64_t n,
                       typename R::Params p, int device, void* stream) {
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const int lanes = lanes_per_row(d);
  elementwise_kernel<R><<<blocks_for(n * lanes), kThreads, 0, as_stream(stream)>>>(
      weight, states, num_rows, d, rows, grads, n, lanes, p);
  return cudaGetLastError();
}

}  // namespace
}  // namespace distemb

using distemb::as_stream;
using distemb::blocks_for;
using distemb::kThreads;
using distemb::kWarp;

DISTEMB_API int distemb_cuda_rowwise_adagrad_update(float* weight, float* state_sum,
                                                    int64_t num_rows, int64_t d,
                                                    const int64_t* rows, const float* grads,
                                                    int64_t n, float clr, float eps,
                                                    int device, void* stream) {
  if (distemb::bad_sizes(num_rows, d, n)) return cudaErrorInvalidValue;
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  distemb::rowwise_adagrad_kernel<<<blocks_for(n * kWarp), kThreads, 0, as_stream(stream)>>>(
      weight, state_sum, num_rows, d, rows, grads, n, clr, eps);
  return cudaGetLastError();
}

DISTEMB_API int distemb_cuda_adam_update(float* weight, float* exp_avg, float* exp_avg_sq,
                                         int64_t num_rows, int64_t d, const int64_t* rows,
                                         const float* grads, int64_t n, double lr, double beta1,
                                         double beta2, double eps, int64_t step,
                                         int64_t* row_steps, int device, void* stream) {
  if (distemb::bad_sizes(num_rows, d, n) || (row_steps == nullptr && step < 1)) {
    return cudaErrorInvalidValue;
  }
  DISTEMB_TRY(cudaSetDevice(device));
  if (n == 0) return cudaSuccess;
  const float global_step_size =
      row_steps == nullptr
          ? distemb::rules::adam_step_size(lr, beta1, beta2, static_cast<double>(step))
          : 0.0f;
  distemb::adam_kernel<<<blocks_for(n * kWarp), kThreads, 0, as_stream(stream)>>>(
      weight, exp_avg, exp_avg_sq, num_rows, d, rows, grads, n, lr, beta1, beta2,
      static_cast<float>(eps), global_step_size, row_steps);
  return cudaGetLastError();
}

// The entry points of the element-wise rules, generated from distemb/kernels/rule_table.py.
#include "../gen/cuda_optim_rules.inc"
