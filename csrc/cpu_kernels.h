// The CPU kernels (csrc/cpu_kernels_body.h: the updates on float32 and half rows, the
// gathers, the id sort and the duplicate sums of dedup), compiled three times from the
// one body and picked at run time:
//   0 baseline: any x86-64 CPU (SSE2), or any other CPU;
//   1 avx2:     AVX2 + FMA + F16C (8-lane float32 maths, 8-lane float16 conversions);
//   2 avx512:   AVX-512 F/BW/VL on top of those (16-lane maths and conversions).
// Each build is a namespace compiled under its own `#pragma GCC target`, so no -m / -march
// flag decides anything: a wheel built on one machine runs on another at its best build.
// The process uses the best build the CPU runs, unless set_process_isa chose one
// (distemb.kernels: DISTEMB_CPU_ISA for a process, kernels.cpu_isa() for a block).
//
// Every build gives the same bits. FMA is on in builds 1 and 2, but the extensions are
// compiled with -ffp-contract=off, so the compiler never fuses `w - lr * g` (SGD,
// Adagrad) or `m + (g - m) * (1 - beta1)` (Adam) into one fused multiply-add: a fused
// operation skips a rounding and would move the result by an ulp away from torch's, the
// numpy oracle's and the GPU's (built with -fmad=false). Wider vectors change nothing
// else: every element is computed alone, in the same order, with IEEE float32 operations
// (sqrt and division are correctly rounded in every width); the row-wise Adagrad sum of
// g^2 and dedup's duplicate sums keep their left-to-right order (no reassociation without
// -ffast-math). The one exception is FTRL with a learning_rate_power other than -0.5 or 0:
// it calls libm's powf, the same scalar function in every build (not vectorised), so
// still the same bits.
// Included by csrc/_kernels.pyx (float32) and csrc/_halfkernels.pyx (half rows).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
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
#pragma GCC target("avx2,fma,f16c")
namespace distemb_cpu {
namespace avx2 {
#define DISTEMB_CPU_VECTOR 1
#include "cpu_kernels_body.h"
#undef DISTEMB_CPU_VECTOR
}  // namespace avx2
}  // namespace distemb_cpu
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")
// gcc 12's own avx512fintrin.h trips -Wmaybe-uninitialized (_mm512_undefined_*, gcc PR
// 105593): a false alarm in the compiler's header, silenced for this build only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace distemb_cpu {
namespace avx512 {
#define DISTEMB_CPU_VECTOR 2
#include "cpu_kernels_body.h"
#undef DISTEMB_CPU_VECTOR
}  // namespace avx512
}  // namespace distemb_cpu
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace distemb_cpu {

enum Isa { ISA_BASELINE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_COUNT = 3 };

// Whether this CPU (and its OS: the CPU model code checks XGETBV) runs build `isa`.
inline bool cpu_supports(int isa) {
#if DISTEMB_CPU_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  return isa == ISA_BASELINE || (isa == ISA_AVX2 && avx2) || (isa == ISA_AVX512 && avx512);
#else
  return isa == ISA_BASELINE;
#endif
}

// The best build this CPU runs.
inline int best_isa() {
  for (int isa = ISA_COUNT - 1; isa > 0; --isa)
    if (cpu_supports(isa)) return isa;
  return ISA_BASELINE;
}

// The build this process runs when a call asks for -1: -1 the best this CPU runs (the
// default), else an Isa the caller checked with cpu_supports. Set once per module
// (set_process_isa); each extension module that includes this header has its own copy.
inline int &process_isa() {
  static int isa = -1;
  return isa;
}
inline int get_process_isa() { return process_isa(); }
inline void set_process_isa(int isa) { process_isa() = isa; }

// The build a call with ``isa`` runs: -1 the process's choice, else ``isa`` itself.
inline int resolve_isa(int isa) {
  if (isa < 0) isa = process_isa();
  return isa < 0 ? best_isa() : isa;
}

#if DISTEMB_CPU_X86
#define DISTEMB_CPU_ISA(fn, ...)                   \
  do {                                             \
    switch (resolve_isa(isa)) {                    \
      case ISA_AVX512: avx512::fn(__VA_ARGS__); break; \
      case ISA_AVX2: avx2::fn(__VA_ARGS__); break; \
      default: generic::fn(__VA_ARGS__);           \
    }                                              \
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
inline void gather_f32(const float *t, const int64_t *r, float *o, int64_t n, int64_t d,
                       int nt) {
  const int isa = -1;
  DISTEMB_CPU_ISA(gather_f32, t, r, o, n, d, nt);
}
inline int64_t dedup_order(const int64_t *ids, int64_t n, int64_t *order, int64_t *starts) {
  const int isa = -1;
  int64_t nu = 0;
  DISTEMB_CPU_ISA(dedup_order_into, ids, n, order, starts, &nu);
  return nu;
}
inline void segment_sum(const int64_t *ids, const float *g, int64_t d, const int64_t *order,
                        const int64_t *starts, int64_t nu, int64_t *uniq, float *out,
                        int nt) {
  const int isa = -1;
  DISTEMB_CPU_ISA(segment_sum, ids, g, d, order, starts, nu, uniq, out, nt);
}
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
