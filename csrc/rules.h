// The per-element arithmetic of every update rule, written once.
//
// Every compiled build runs these functions: the CPU kernels on float32 and on half rows
// (csrc/cpu_kernels_body.h, through csrc/_kernels.pyx and csrc/_halfkernels.pyx), the
// CUDA kernels (csrc/cuda/optim.cu, csrc/cuda/half_kernels.cuh) and their CPU emulation
// (tests/cuda_host/, which compiles the .cuh files as plain C++). A kernel only loads a
// row's values as float32, calls the rule here per element, and stores the result in its
// row format; so the maths of a rule lives in one place and every build rounds the same
// way (IEEE float32, one operation at a time: the CPU builds are compiled without FMA
// contraction, CUDA with -fmad=false). The independent oracle is the numpy twin in
// distemb/kernels/reference.py, written separately from this file on purpose.
//
// An element-wise rule (one whose element needs only its own weight, gradient and state) is
// also a struct below (Sgd, Adagrad, Ftrl): its number of float32 state arrays, its
// parameters built once per call from the hyperparameters (doubles, in the order of
// distemb/kernels/rule_table.py) and its per-element update. The kernels of every build
// are one template over such a struct, and their entry points are generated from the
// table (csrc/codegen.py, run by setup.py). Adding one: README.md "Adding an optimizer".
#ifndef DISTEMB_RULES_H_
#define DISTEMB_RULES_H_

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define DISTEMB_RULE __host__ __device__ __forceinline__
#define DISTEMB_RULE_MEMBER __host__ __device__ __forceinline__ static
#else
#define DISTEMB_RULE static inline
#define DISTEMB_RULE_MEMBER static inline
#endif

namespace distemb {
namespace rules {

// SGD: w - lr * g.
DISTEMB_RULE float sgd(float w, float g, float lr) { return w - lr * g; }

// torch.optim.Adagrad: s += g^2 (in place); w - clr * (g / (sqrt(s) + eps)).
DISTEMB_RULE float adagrad(float w, float g, float& s, float clr, float eps) {
  const float sj = s + g * g;
  s = sj;
  return w - clr * (g / (sqrtf(sj) + eps));
}

// Row-wise Adagrad, in three parts: the row's sum of g^2 (left to right), the row's new
// accumulator from it, and each element's update with the row's denominator.
DISTEMB_RULE float rowwise_sum_sq(float acc, float g) { return acc + g * g; }
DISTEMB_RULE float rowwise_state(float s, float sum_sq, int64_t d) {
  return s + sum_sq / static_cast<float>(d);
}
DISTEMB_RULE float rowwise_denominator(float s, float eps) { return sqrtf(s) + eps; }
DISTEMB_RULE float rowwise_adagrad(float w, float g, float clr, float denominator) {
  return w - clr * (g / denominator);
}

// Adam's step size for bias-corrected moments after `step` steps, in double, rounded
// once (as torch.optim.SparseAdam computes it).
DISTEMB_RULE float adam_step_size(double lr, double beta1, double beta2, double step) {
  return static_cast<float>(lr * sqrt(1.0 - pow(beta2, step)) / (1.0 - pow(beta1, step)));
}

// Adam's moment weights: 1 - beta in double, then rounded, as torch computes it.
DISTEMB_RULE float adam_one_minus(double beta) { return static_cast<float>(1.0 - beta); }

// torch.optim.SparseAdam: m, v updated in place with omb = adam_one_minus(beta);
// w - step_size * (m / (sqrt(v) + eps)).
DISTEMB_RULE float adam(float w, float g, float& m, float& v, float omb1, float omb2,
                        float step_size, float eps) {
  const float mj = m + (g - m) * omb1;
  const float vj = v + (g * g - v) * omb2;
  m = mj;
  v = vj;
  return w - step_size * (mj / (sqrtf(vj) + eps));
}

// FTRL-Proximal as tf.keras.optimizers.Ftrl, per element, with accumulator n and linear
// term z (both in place):
//   g' = g + 2 * l2_shrinkage * w;  n' = n + g^2
//   z += g' - (n'^-p - n^-p) / lr * w
//   w = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2 * (l2 + beta / (2 lr)))
// with p = learning_rate_power. n^-p is sqrtf for p = -0.5 and 1 for p = 0 (exact, the
// same on every build); any other p calls powf, which CUDA rounds differently from the
// CPU's libm (within a few ulp), so only those runs are not bit-identical across devices.
struct FtrlParams {
  float lr, neg_power, l1, two_l2, two_shrinkage;
  int power_kind;  // 0: powf(x, neg_power), 1: sqrtf(x), 2: 1
};

DISTEMB_RULE FtrlParams ftrl_params(double lr, double lr_power, double l1, double l2,
                                    double l2_shrinkage, double beta) {
  FtrlParams p;
  p.lr = static_cast<float>(lr);
  p.neg_power = static_cast<float>(-lr_power);
  p.l1 = static_cast<float>(l1);
  p.two_l2 = static_cast<float>(2.0 * (l2 + beta / (2.0 * lr)));
  p.two_shrinkage = static_cast<float>(2.0 * l2_shrinkage);
  p.power_kind = lr_power == -0.5 ? 1 : (lr_power == 0.0 ? 2 : 0);
  return p;
}

DISTEMB_RULE float ftrl_power(float x, const FtrlParams& p) {
  return p.power_kind == 1 ? sqrtf(x) : (p.power_kind == 2 ? 1.0f : powf(x, p.neg_power));
}

DISTEMB_RULE float ftrl(float w, float g, float& n, float& z, const FtrlParams& p) {
  const float shrunk = g + p.two_shrinkage * w;
  const float n_new = n + g * g;
  const float pow_new = ftrl_power(n_new, p);
  const float sigma = (pow_new - ftrl_power(n, p)) / p.lr;
  const float zj = z + (shrunk - sigma * w);
  n = n_new;
  z = zj;
  const float clipped = zj < -p.l1 ? -p.l1 : (zj > p.l1 ? p.l1 : zj);
  return (clipped - zj) / (pow_new / p.lr + p.two_l2);
}

// The element-wise rules as the kernel templates take them. `update` gets the element's
// weight and gradient as float32, the rule's state arrays at the element's row (s[k][j]
// is state k of column j) and the call's parameters, and returns the new weight.
struct Sgd {
  static constexpr int kStates = 0;
  struct Params {
    float lr;
  };
  DISTEMB_RULE_MEMBER Params params(const double* h) { return {static_cast<float>(h[0])}; }
  DISTEMB_RULE_MEMBER float update(float w, float g, float* const*, int64_t, const Params& p) {
    return sgd(w, g, p.lr);
  }
};

struct Adagrad {
  static constexpr int kStates = 1;
  struct Params {
    float clr, eps;
  };
  DISTEMB_RULE_MEMBER Params params(const double* h) {
    return {static_cast<float>(h[0]), static_cast<float>(h[1])};
  }
  DISTEMB_RULE_MEMBER float update(float w, float g, float* const* s, int64_t j,
                                   const Params& p) {
    return adagrad(w, g, s[0][j], p.clr, p.eps);
  }
};

struct Ftrl {
  static constexpr int kStates = 2;
  typedef FtrlParams Params;
  DISTEMB_RULE_MEMBER Params params(const double* h) {
    return ftrl_params(h[0], h[1], h[2], h[3], h[4], h[5]);
  }
  DISTEMB_RULE_MEMBER float update(float w, float g, float* const* s, int64_t j,
                                   const Params& p) {
    return ftrl(w, g, s[0][j], s[1][j], p);
  }
};

}  // namespace rules
}  // namespace distemb

#endif  // DISTEMB_RULES_H_
