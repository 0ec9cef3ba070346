// Kernels on half-precision rows (csrc/half_kernels_body.h), built twice and picked at run
// time: a baseline build that runs on any x86-64 CPU, and one compiled for AVX2 + F16C
// (8-lane float16 conversions, 256-bit bfloat16 rounding), used when the CPU running the
// code has both. Both give the same bits (IEEE round-to-nearest-even either way; tested).
// No build flag decides: a wheel built on one machine runs on another.
// Included by csrc/_halfkernels.pyx only.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DISTEMB_HALF_X86 1
#else
#define DISTEMB_HALF_X86 0
#endif

namespace distemb_half {
namespace generic {
#define DISTEMB_HALF_VECTOR 0
#include "half_kernels_body.h"
#undef DISTEMB_HALF_VECTOR
}  // namespace generic
}  // namespace distemb_half

#if DISTEMB_HALF_X86
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace distemb_half {
namespace avx2 {
#define DISTEMB_HALF_VECTOR 1
#include "half_kernels_body.h"
#undef DISTEMB_HALF_VECTOR
}  // namespace avx2
}  // namespace distemb_half
#pragma GCC pop_options
#endif

namespace distemb_half {

// Whether this CPU runs the AVX2 + F16C build (asked once).
inline bool cpu_has_vector() {
#if DISTEMB_HALF_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// ``isa``: -1 the best this CPU runs, 0 the baseline build, 1 the AVX2 + F16C build (the
// caller checks cpu_has_vector() first).
#if DISTEMB_HALF_X86
#define DISTEMB_HALF_ISA(fn, ...)                                          \
  do {                                                                     \
    if (isa == 1 || (isa < 0 && cpu_has_vector())) avx2::fn(__VA_ARGS__);  \
    else generic::fn(__VA_ARGS__);                                         \
  } while (0)
#else
#define DISTEMB_HALF_ISA(fn, ...) generic::fn(__VA_ARGS__)
#endif

inline void gather(int isa, int kind, const uint16_t *t, const int64_t *r, float *o,
                   int64_t n, int64_t d, int nt) {
  DISTEMB_HALF_ISA(gather, kind, t, r, o, n, d, nt);
}
inline void sgd(int isa, int kind, uint16_t *w, const int64_t *r, const float *g, int64_t n,
                int64_t d, float lr, uint64_t seed, int nt) {
  DISTEMB_HALF_ISA(sgd, kind, w, r, g, n, d, lr, seed, nt);
}
inline void adagrad(int isa, int kind, uint16_t *w, float *s, const int64_t *r,
                    const float *g, int64_t n, int64_t d, float clr, float eps, uint64_t seed,
                    int nt) {
  DISTEMB_HALF_ISA(adagrad, kind, w, s, r, g, n, d, clr, eps, seed, nt);
}
inline void rowwise_adagrad(int isa, int kind, uint16_t *w, float *s, const int64_t *r,
                            const float *g, int64_t n, int64_t d, float clr, float eps,
                            uint64_t seed, int nt) {
  DISTEMB_HALF_ISA(rowwise_adagrad, kind, w, s, r, g, n, d, clr, eps, seed, nt);
}
inline void adam(int isa, int kind, uint16_t *w, float *m, float *v, const int64_t *r,
                 const float *g, int64_t n, int64_t d, double lr, double b1, double b2,
                 double eps, int64_t step, int64_t *rs, uint64_t seed, int nt) {
  DISTEMB_HALF_ISA(adam, kind, w, m, v, r, g, n, d, lr, b1, b2, eps, step, rs, seed, nt);
}
inline void encode(int isa, int kind, const float *src, uint16_t *dst, int64_t n) {
  DISTEMB_HALF_ISA(encode, kind, src, dst, n);
}
inline void decode(int isa, int kind, const uint16_t *src, float *dst, int64_t n) {
  DISTEMB_HALF_ISA(decode, kind, src, dst, n);
}

}  // namespace distemb_half
