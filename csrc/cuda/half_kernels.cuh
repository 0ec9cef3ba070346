// Kernels on half-precision rows (bfloat16 or IEEE float16, as uint16 bits) with float32
// gradients, state and maths: the checked gather to float32 rows and the fused updates.
// Internal to half.cu. Their per-element arithmetic is csrc/rules.h, as in the CPU kernels
// (csrc/cpu_kernels.h), with the same rounding on store (nearest-even, or bfloat16 stochastic
// rounding from a hash of (seed, row, column)), so a GPU update equals the CPU one bit for
// bit (the build's -fmad=false keeps multiply-adds unfused, as on the CPU).
//
// Only thread indexing and __syncwarp are used, and conversions are written in integer
// arithmetic rather than with cuda_fp16/cuda_bf16 intrinsics, so tests/cuda_host/
// compiles these kernels as plain C++ and runs them thread by thread
// (tests/test_cuda_half_emulated.py). Where lanes share a per-row value (row-wise
// Adagrad's accumulator, Adam's per-row step count), every lane reads it, the warp syncs,
// and the LAST lane writes it: correct on the GPU, and in a sequential emulation too
// (the last lane runs after the others have read).
#ifndef DISTEMB_CUDA_HALF_KERNELS_CUH_
#define DISTEMB_CUDA_HALF_KERNELS_CUH_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../rules.h"
#include "indexing.cuh"

namespace distemb {
namespace half {

enum Kind { kBF16 = 0, kF16 = 1, kBF16SR = 2 };

__device__ __host__ inline float as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

__device__ __host__ inline uint32_t as_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

__device__ __host__ inline uint64_t splitmix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// The random stream of one row of one update call (as csrc/cpu_kernels.h).
__device__ __host__ inline uint64_t row_stream(uint64_t seed, int64_t slot) {
  return splitmix(seed ^ splitmix(static_cast<uint64_t>(slot)));
}

struct BF16 {
  __device__ __host__ static float load(uint16_t h) {
    return as_float(static_cast<uint32_t>(h) << 16);
  }
  // Nearest, ties to even; a NaN stays a quiet NaN.
  __device__ __host__ static uint16_t store(float f, uint64_t, int64_t) {
    const uint32_t u = as_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

// bfloat16, rounded up with probability by distance: 16 random bits added below the kept
// ones, then truncated.
struct BF16SR {
  __device__ __host__ static float load(uint16_t h) { return BF16::load(h); }
  __device__ __host__ static uint16_t store(float f, uint64_t stream, int64_t j) {
    const uint32_t u = as_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    const uint32_t rnd = static_cast<uint32_t>(
        splitmix(stream + static_cast<uint64_t>(j + 1) * kGolden) >> 48);
    return static_cast<uint16_t>((u + rnd) >> 16);
  }
};

// IEEE binary16, converted exactly as the CPU's _Float16 / F16C conversions (nearest,
// ties to even; overflow to infinity; subnormals kept).
struct F16 {
  __device__ __host__ static float load(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1fu) return as_float(sign | 0x7f800000u | (m << 13));  // inf, NaN
    if (e != 0) return as_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return as_float(sign);
    uint32_t k = 0;  // a subnormal: m * 2^-24, normalised
    while (!(m & 0x400u)) {
      m <<= 1;
      ++k;
    }
    return as_float(sign | ((113u - k) << 23) | ((m & 0x3ffu) << 13));
  }
  __device__ __host__ static uint16_t store(float f, uint64_t, int64_t) {
    const uint32_t x = as_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
    if (a >= 0x38800000u) {  // a normal binary16: rebias the exponent, round the mantissa
      const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
      return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
    }
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // under 2^-25: zero
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;  // a subnormal, in units of 2^-24
    const uint32_t shift = 126u - (a >> 23);
    const uint32_t half = 1u << (shift - 1), rem = m & ((1u << shift) - 1u);
    uint32_t r = m >> shift;
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
};

// A row outside [0, num_rows) is skipped by the updates (as gather_checked reports it).
__device__ __host__ inline bool out_of_table(int64_t r, int64_t num_rows) {
  return r < 0 || r >= num_rows;
}

template <class C>
__global__ void gather_checked_kernel(const uint16_t* table, int64_t num_rows, int64_t d,
                                      const int64_t* rows, int64_t n, int lanes, float* out,
                                      long long* flags) {
  const int lane = threadIdx.x % lanes;
  for (int64_t i = first_row(lanes); i < n; i += row_stride(lanes)) {
    const int64_t r = rows[i];
    float* dst = out + i * d;
    if (out_of_table(r, num_rows)) {
      if (lane == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(flags), 1ull);
        atomicMin(flags + 1, static_cast<long long>(r));
        atomicMax(flags + 2, static_cast<long long>(r));
      }
      for (int64_t j = lane; j < d; j += lanes) dst[j] = 0.0f;
      continue;
    }
    const uint16_t* src = table + r * d;
    for (int64_t j = lane; j < d; j += lanes) dst[j] = C::load(src[j]);
  }
}

// Every element-wise rule R (csrc/rules.h: Sgd, Adagrad, Ftrl, ...) on half rows: each
// element is loaded as float32, updated by R::update with the row's R::kStates state
// arrays, and rounded on store. Entry points: csrc/gen/cuda_half_rules.inc (generated).
template <class C, class R>
__global__ void elementwise_kernel(uint16_t* weight, StatePtrs<R::kStates> states,
                                   int64_t num_rows, int64_t d, const int64_t* rows,
                                   const float* grads, int64_t n, int lanes,
                                   typename R::Params p, uint64_t seed) {
  const int lane = threadIdx.x % lanes;
  for (int64_t i = first_row(lanes); i < n; i += row_stride(lanes)) {
    const int64_t r = rows[i];
    if (out_of_table(r, num_rows)) continue;
    const uint64_t stream = row_stream(seed, r);
    const int64_t base = r * d;
    float* s[R::kStates > 0 ? R::kStates : 1];
    for (int k = 0; k < R::kStates; ++k) s[k] = states.p[k] + base;
    uint16_t* w = weight + base;
    const float* g = grads + i * d;
    for (int64_t j = lane; j < d; j += lanes) {
      w[j] = C::store(R::update(C::load(w[j]), g[j], s, j, p), stream, j);
    }
  }
}

// One warp per row. Every lane sums the row's squared gradient itself, left to right as
// the CPU does (the row is read from cache), so the accumulator is the CPU's bit for bit.
template <class C>
__global__ void rowwise_adagrad_kernel(uint16_t* weight, float* state_sum, int64_t num_rows,
                                       int64_t d, const int64_t* rows, const float* grads,
                                       int64_t n, float clr, float eps, uint64_t seed) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t i = first_row(kWarp); i < n; i += row_stride(kWarp)) {
    const int64_t r = rows[i];
    if (out_of_table(r, num_rows)) continue;  // the whole warp: it shares the row
    const float* g = grads + i * d;
    float acc = 0.0f;
    for (int64_t j = 0; j < d; ++j) acc = rules::rowwise_sum_sq(acc, g[j]);
    const float s = rules::rowwise_state(state_sum[r], acc, d);
    __syncwarp();  // every lane has read state_sum[r] before the last lane writes it
    if (lane == kWarp - 1) state_sum[r] = s;
    const float den = rules::rowwise_denominator(s, eps);
    const uint64_t stream = row_stream(seed, r);
    uint16_t* w = weight + r * d;
    for (int64_t j = lane; j < d; j += kWarp) {
      w[j] = C::store(rules::rowwise_adagrad(C::load(w[j]), g[j], clr, den), stream, j);
    }
  }
}

// One warp per row, so that a row's step count is read by all lanes, then bumped once.
template <class C>
__global__ void adam_kernel(uint16_t* weight, float* exp_avg, float* exp_avg_sq,
                            int64_t num_rows, int64_t d, const int64_t* rows,
                            const float* grads, int64_t n, double lr, double beta1,
                            double beta2, float eps, float global_step_size,
                            int64_t* row_steps, uint64_t seed) {
  const int lane = threadIdx.x % kWarp;
  const float omb1 = rules::adam_one_minus(beta1), omb2 = rules::adam_one_minus(beta2);
  for (int64_t i = first_row(kWarp); i < n; i += row_stride(kWarp)) {
    const int64_t r = rows[i];
    if (out_of_table(r, num_rows)) continue;  // the whole warp: it shares the row
    float step_size = global_step_size;
    if (row_steps != nullptr) {
      const int64_t st = row_steps[r] + 1;
      step_size = rules::adam_step_size(lr, beta1, beta2, static_cast<double>(st));
      __syncwarp();  // every lane has read row_steps[r] before the last lane writes it
      if (lane == kWarp - 1) row_steps[r] = st;
    }
    const uint64_t stream = row_stream(seed, r);
    const float* g = grads + i * d;
    const int64_t base = r * d;
    for (int64_t j = lane; j < d; j += kWarp) {
      const float w = rules::adam(C::load(weight[base + j]), g[j], exp_avg[base + j],
                                  exp_avg_sq[base + j], omb1, omb2, step_size, eps);
      weight[base + j] = C::store(w, stream, j);
    }
  }
}

}  // namespace half
}  // namespace distemb

#endif  // DISTEMB_CUDA_HALF_KERNELS_CUH_
