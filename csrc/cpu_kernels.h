// The CPU update kernels on float32 and half rows (csrc/cpu_kernels_body.h), built twice
// and picked at run time: a baseline build that runs on any x86-64 CPU, and one compiled
// for AVX2 + F16C (8-lane float32 maths, 8-lane float16 conversions, 256-bit bfloat16
// rounding), used when the CPU running the code has both. No build flag decides: a wheel
// built on one machine runs on another.
//
// Both builds give the same bits. Neither enables FMA: contracting ``w - lr * g`` (SGD,
// Adagrad) or ``m + (g - m) * (1 - beta1)`` (Adam) into one fused multiply-add would skip
// a rounding and change the result in the last bit, away from torch's and the numpy
// oracle's, and from the GPU's (built with -fmad=false); the updates are bound by memory
// and by float32 sqrt and division, not by multiply-adds. The build's -std=c++17 (ISO
// mode) also keeps gcc from contracting on its own.
// Included by csrc/_kernels.pyx (float32) and csrc/_halfkernels.pyx (half rows).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DISTEMB_CPU_X86 1
#else
#define DISTEMB_CPU_X86 0
#endif

#include "rules.h"

namespace distemb_cpu {
namespace generic {
#define DISTEMB_CPU_VECTOR 0
#include "cpu_kernels_body.h"
#undef DISTEMB_CPU_VECTOR
}  // namespace generic
}  // namespace distemb_cpu

#if DISTEMB_CPU_X86
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace distemb_cpu {
namespace avx2 {
#define DISTEMB_CPU_VECTOR 1
#include "cpu_kernels_body.h"
#undef DISTEMB_CPU_VECTOR
}  // namespace avx2
}  // namespace distemb_cpu
#pragma GCC pop_options
#endif

namespace distemb_cpu {

// Whether this CPU runs the AVX2 + F16C build (asked once).
inline bool cpu_has_vector() {
#if DISTEMB_CPU_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// The build this process runs when a call asks for -1: -1 the best this CPU runs (the
// default), 0 the baseline, 1 AVX2 + F16C. Set once per module (set_process_isa); each
// extension module that includes this header has its own copy.
inline int &process_isa() {
  static int isa = -1;
  return isa;
}
inline int get_process_isa() { return process_isa(); }
inline void set_process_isa(int isa) { process_isa() = isa; }

// ``isa``: -1 the process's choice (process_isa), 0 the baseline build, 1 the AVX2 + F16C
// build (the caller checks cpu_has_vector() first).
inline bool use_vector(int isa) {
  if (isa < 0) isa = process_isa();
  return isa == 1 || (isa < 0 && cpu_has_vector());
}

#if DISTEMB_CPU_X86
#define DISTEMB_CPU_ISA(fn, ...)                \
  do {                                          \
    if (use_vector(isa)) avx2::fn(__VA_ARGS__); \
    else generic::fn(__VA_ARGS__);              \
  } while (0)
#else
#define DISTEMB_CPU_ISA(fn, ...) generic::fn(__VA_ARGS__)
#endif

inline void gather(int isa, int kind, const uint16_t *t, const int64_t *r, float *o,
                   int64_t n, int64_t d, int nt) {
  DISTEMB_CPU_ISA(gather, kind, t, r, o, n, d, nt);
}
inline void rowwise_adagrad(int isa, int kind, uint16_t *w, float *s, const int64_t *r,
                            const float *g, int64_t n, int64_t d, float clr, float eps,
                            uint64_t seed, int nt) {
  DISTEMB_CPU_ISA(rowwise_adagrad, kind, w, s, r, g, n, d, clr, eps, seed, nt);
}
inline void adam(int isa, int kind, uint16_t *w, float *m, float *v, const int64_t *r,
                 const float *g, int64_t n, int64_t d, double lr, double b1, double b2,
                 double eps, int64_t step, int64_t *rs, uint64_t seed, int nt) {
  DISTEMB_CPU_ISA(adam, kind, w, m, v, r, g, n, d, lr, b1, b2, eps, step, rs, seed, nt);
}
inline void encode(int isa, int kind, const float *src, uint16_t *dst, int64_t n) {
  DISTEMB_CPU_ISA(encode, kind, src, dst, n);
}
inline void decode(int isa, int kind, const uint16_t *src, float *dst, int64_t n) {
  DISTEMB_CPU_ISA(decode, kind, src, dst, n);
}

// float32 rows, always at the process's choice of build.
inline void rowwise_adagrad_f32(float *w, float *s, const int64_t *r, const float *g,
                                int64_t n, int64_t d, float clr, float eps, int nt) {
  const int isa = -1;
  DISTEMB_CPU_ISA(rowwise_adagrad_f32, w, s, r, g, n, d, clr, eps, nt);
}
inline void adam_f32(float *w, float *m, float *v, const int64_t *r, const float *g, int64_t n,
                     int64_t d, double lr, double b1, double b2, double eps, int64_t step,
                     int64_t *rs, int nt) {
  const int isa = -1;
  DISTEMB_CPU_ISA(adam_f32, w, m, v, r, g, n, d, lr, b1, b2, eps, step, rs, nt);
}

// The entry points of the element-wise rules (Sgd, Adagrad, Ftrl, ...), generated from
// distemb/kernels/rule_table.py by csrc/codegen.py (setup.py runs it).
#include "gen/cpu_rules.h"

}  // namespace distemb_cpu
