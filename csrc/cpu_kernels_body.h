// The CPU update kernels, templated on the row format: float32 rows (updated in place)
// and half rows (bfloat16 or IEEE float16 storage, uint16 bits; float32 gradients, state
// and maths). Each update loads a row as float32, applies the rule's per-element
// arithmetic from csrc/rules.h (the one definition every build shares), and stores it
// back: in place for float32, rounded to nearest-even (or stochastically) for half rows,
// so a half kernel equals "decode, float32 kernel, encode", bit for bit.
// Included once per instruction set by csrc/cpu_kernels.h (DISTEMB_CPU_VECTOR 0: baseline
// x86-64 / any CPU, 1: compiled for AVX2 + FMA + F16C, 2: for AVX-512 F/BW/VL on top),
// each time inside its own namespace: no include guard, no includes of its own.

enum Kind { BF16 = 0, F16 = 1 };
static const int64_t PREFETCH_AHEAD = 8;
static const int CHUNK_ROWS = 64;

// float32 rows: the updates work on the row itself (RowView never copies); a gather
// copies it.
struct F32Row {
  typedef float T;
  static const bool kInPlace = true;
  static inline void load_row(const float *src, float *dst, int64_t d) {
    std::memcpy(dst, src, d * sizeof(float));
  }
  static inline void store_row(const float *, float *, int64_t, uint64_t) {}
};

struct BF16Conv {
  typedef uint16_t T;
  static const bool kInPlace = false;
  static inline float load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    // round to nearest, ties to even; NaN stays a (quiet) NaN. Both computed and selected
    // without a branch, so the row loops below vectorise.
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
  }
  static inline void load_row(const uint16_t *src, float *dst, int64_t d) {
    for (int64_t j = 0; j < d; ++j) dst[j] = load(src[j]);
  }
  static inline void store_row(const float *src, uint16_t *dst, int64_t d, uint64_t) {
    for (int64_t j = 0; j < d; ++j) dst[j] = store(src[j]);
  }
};

static inline uint64_t splitmix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
static const uint64_t GOLDEN = 0x9e3779b97f4a7c15ULL;

// bfloat16 with stochastic rounding: add 16 random bits below the kept ones, truncate, so
// a value rounds up with probability equal to its distance from the lower neighbour
// (unbiased: updates smaller than half an ulp survive in expectation). The bits are a
// hash of (seed, slot, column): reproducible for any thread count or schedule.
struct BF16SRConv {
  typedef uint16_t T;
  static const bool kInPlace = false;
  static inline float load(uint16_t h) { return BF16Conv::load(h); }
  static inline void load_row(const uint16_t *src, float *dst, int64_t d) {
    BF16Conv::load_row(src, dst, d);
  }
  static inline void store_row(const float *src, uint16_t *dst, int64_t d, uint64_t stream) {
    for (int64_t j = 0; j < d; ++j) {
      uint32_t u;
      std::memcpy(&u, &src[j], 4);
      uint32_t rnd = (uint32_t)(splitmix(stream + (uint64_t)(j + 1) * GOLDEN) >> 48);
      uint32_t nan = (u >> 16) | 0x40u;
      dst[j] = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : (u + rnd) >> 16);
    }
  }
};

// The random stream of one row of one update call.
static inline uint64_t row_stream(uint64_t seed, int64_t slot) {
  return splitmix(seed ^ splitmix((uint64_t)slot));
}

struct F16Conv {
  typedef uint16_t T;
  static const bool kInPlace = false;
  static inline float load(uint16_t h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
  }
  static inline uint16_t store(float f) {
    _Float16 x = (_Float16)f;  // IEEE conversion: round to nearest, ties to even
    uint16_t h;
    std::memcpy(&h, &x, 2);
    return h;
  }
  // gcc does not vectorise _Float16 conversions: with F16C, 8 lanes per instruction (16
  // with AVX-512; both round to nearest even, as the scalar conversion does)
  static inline void load_row(const uint16_t *src, float *dst, int64_t d) {
    int64_t j = 0;
#if DISTEMB_CPU_VECTOR >= 2
    for (; j + 16 <= d; j += 16)
      _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + j))));
#endif
#if DISTEMB_CPU_VECTOR
    for (; j + 8 <= d; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
#endif
    for (; j < d; ++j) dst[j] = load(src[j]);
  }
  static inline void store_row(const float *src, uint16_t *dst, int64_t d, uint64_t) {
    int64_t j = 0;
#if DISTEMB_CPU_VECTOR >= 2
    for (; j + 16 <= d; j += 16)
      _mm256_storeu_si256((__m256i *)(dst + j),
                          _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
#if DISTEMB_CPU_VECTOR
    for (; j + 8 <= d; j += 8)
      _mm_storeu_si128((__m128i *)(dst + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < d; ++j) dst[j] = store(src[j]);
  }
};

// Prefetch a row about to be written (updates) or, with write=false, only read (gathers).
static inline void prefetch(const void *p, long nbytes, bool write = true) {
  const char *c = (const char *)p;
  for (long off = 0; off < nbytes; off += 64) {
    if (write) __builtin_prefetch(c + off, 1, 3);
    else __builtin_prefetch(c + off, 0, 3);
  }
}

// One thread's float32 view of the row being updated: the row itself for float32 rows,
// a decoded copy in a per-thread buffer for half rows (encoded back by store()).
template <class C>
struct RowView {
  std::vector<float> buf;
  explicit RowView(int64_t d) : buf(C::kInPlace ? 0 : d) {}
  inline float *load(typename C::T *row, int64_t d) {
    if (C::kInPlace) return reinterpret_cast<float *>(row);
    C::load_row(row, buf.data(), d);
    return buf.data();
  }
  inline void store(const float *w, typename C::T *row, int64_t d, uint64_t seed,
                    int64_t slot) {
    if (!C::kInPlace) C::store_row(w, row, d, row_stream(seed, slot));
  }
};

template <class C>
void gather_t(const typename C::T *t, const int64_t *r, float *o, int64_t n, int64_t d,
              int nt) {
#pragma omp parallel for schedule(dynamic, CHUNK_ROWS) num_threads(nt)
  for (int64_t i = 0; i < n; ++i) {
    if (i + PREFETCH_AHEAD < n) prefetch(t + r[i + PREFETCH_AHEAD] * d, d * sizeof(*t), false);
    C::load_row(t + r[i] * d, o + i * d, d);
  }
}

// Every element-wise rule R (a struct of csrc/rules.h: Sgd, Adagrad, Ftrl, ...): each
// element is R::update of its weight, gradient and the row's R::kStates state arrays.
// Its entry points (float32 and half rows, every ISA build) are generated from
// distemb/kernels/rule_table.py into csrc/gen/cpu_rules.h.
template <class C, class R>
void elementwise_t(typename C::T *w0, float *const *s0, const int64_t *r, const float *g0,
                   int64_t n, int64_t d, const typename R::Params p, uint64_t seed, int nt) {
#pragma omp parallel num_threads(nt)
  {
    RowView<C> view(d);
#pragma omp for schedule(dynamic, CHUNK_ROWS)
    for (int64_t i = 0; i < n; ++i) {
      if (i + PREFETCH_AHEAD < n) {
        prefetch(w0 + r[i + PREFETCH_AHEAD] * d, d * sizeof(*w0));
        for (int k = 0; k < R::kStates; ++k) prefetch(s0[k] + r[i + PREFETCH_AHEAD] * d, d * 4);
      }
      float *s[R::kStates > 0 ? R::kStates : 1];
      for (int k = 0; k < R::kStates; ++k) s[k] = s0[k] + r[i] * d;
      const float *g = g0 + i * d;
      float *w = view.load(w0 + r[i] * d, d);
      for (int64_t j = 0; j < d; ++j) w[j] = R::update(w[j], g[j], s, j, p);
      view.store(w, w0 + r[i] * d, d, seed, r[i]);
    }
  }
}

template <class C>
void rowwise_adagrad_t(typename C::T *w0, float *s, const int64_t *r, const float *g0,
                       int64_t n, int64_t d, float clr, float eps, uint64_t seed, int nt) {
#pragma omp parallel num_threads(nt)
  {
    RowView<C> view(d);
#pragma omp for schedule(dynamic, CHUNK_ROWS)
    for (int64_t i = 0; i < n; ++i) {
      if (i + PREFETCH_AHEAD < n) {
        prefetch(w0 + r[i + PREFETCH_AHEAD] * d, d * sizeof(*w0));
        prefetch(s + r[i + PREFETCH_AHEAD], 4);
      }
      const float *g = g0 + i * d;
      float acc = 0;
      for (int64_t j = 0; j < d; ++j) acc = distemb::rules::rowwise_sum_sq(acc, g[j]);
      s[r[i]] = distemb::rules::rowwise_state(s[r[i]], acc, d);
      const float den = distemb::rules::rowwise_denominator(s[r[i]], eps);
      float *w = view.load(w0 + r[i] * d, d);
      for (int64_t j = 0; j < d; ++j) w[j] = distemb::rules::rowwise_adagrad(w[j], g[j], clr, den);
      view.store(w, w0 + r[i] * d, d, seed, r[i]);
    }
  }
}

template <class C>
void adam_t(typename C::T *w0, float *m0, float *v0, const int64_t *r, const float *g0,
            int64_t n, int64_t d, double lr, double beta1, double beta2, double eps,
            int64_t step, int64_t *rs, uint64_t seed, int nt) {
  const float omb1 = distemb::rules::adam_one_minus(beta1);
  const float omb2 = distemb::rules::adam_one_minus(beta2), feps = (float)eps;
  float global_size = rs ? 0.0f : distemb::rules::adam_step_size(lr, beta1, beta2, (double)step);
#pragma omp parallel num_threads(nt)
  {
    RowView<C> view(d);
#pragma omp for schedule(dynamic, CHUNK_ROWS)
    for (int64_t i = 0; i < n; ++i) {
      if (i + PREFETCH_AHEAD < n) {
        prefetch(w0 + r[i + PREFETCH_AHEAD] * d, d * sizeof(*w0));
        prefetch(m0 + r[i + PREFETCH_AHEAD] * d, d * 4);
        prefetch(v0 + r[i + PREFETCH_AHEAD] * d, d * 4);
      }
      float fstep = global_size;
      if (rs) {
        rs[r[i]] += 1;
        fstep = distemb::rules::adam_step_size(lr, beta1, beta2, (double)rs[r[i]]);
      }
      float *m = m0 + r[i] * d;
      float *v = v0 + r[i] * d;
      const float *g = g0 + i * d;
      float *w = view.load(w0 + r[i] * d, d);
      for (int64_t j = 0; j < d; ++j)
        w[j] = distemb::rules::adam(w[j], g[j], m[j], v[j], omb1, omb2, fstep, feps);
      view.store(w, w0 + r[i] * d, d, seed, r[i]);
    }
  }
}

template <class C>
void encode_t(const float *src, uint16_t *dst, int64_t n) { C::store_row(src, dst, n, 0); }

template <class C>
void decode_t(const uint16_t *src, float *dst, int64_t n) { C::load_row(src, dst, n); }

// The half entry points: ``kind`` picks the format once per call (0 bfloat16, 1 float16,
// 2 bfloat16 with stochastic rounding, which only the updates use).
enum { BF16_SR = 2 };
#define DISTEMB_HALF_DISPATCH(fn, ...)                  \
  do {                                                  \
    if (kind == BF16) fn<BF16Conv>(__VA_ARGS__);        \
    else if (kind == F16) fn<F16Conv>(__VA_ARGS__);     \
    else fn<BF16SRConv>(__VA_ARGS__);                   \
  } while (0)

inline void gather(int kind, const uint16_t *t, const int64_t *r, float *o, int64_t n,
                   int64_t d, int nt) { DISTEMB_HALF_DISPATCH(gather_t, t, r, o, n, d, nt); }
inline void rowwise_adagrad(int kind, uint16_t *w, float *s, const int64_t *r, const float *g,
                            int64_t n, int64_t d, float clr, float eps, uint64_t seed, int nt) {
  DISTEMB_HALF_DISPATCH(rowwise_adagrad_t, w, s, r, g, n, d, clr, eps, seed, nt);
}
inline void adam(int kind, uint16_t *w, float *m, float *v, const int64_t *r, const float *g,
                 int64_t n, int64_t d, double lr, double b1, double b2, double eps,
                 int64_t step, int64_t *rs, uint64_t seed, int nt) {
  DISTEMB_HALF_DISPATCH(adam_t, w, m, v, r, g, n, d, lr, b1, b2, eps, step, rs, seed, nt);
}
// An element-wise rule on half rows (generated entry points: csrc/gen/cpu_rules.h).
template <class R>
inline void elementwise(int kind, uint16_t *w, float *const *s, const int64_t *r,
                        const float *g, int64_t n, int64_t d, const typename R::Params &p,
                        uint64_t seed, int nt) {
  if (kind == BF16) elementwise_t<BF16Conv, R>(w, s, r, g, n, d, p, seed, nt);
  else if (kind == F16) elementwise_t<F16Conv, R>(w, s, r, g, n, d, p, seed, nt);
  else elementwise_t<BF16SRConv, R>(w, s, r, g, n, d, p, seed, nt);
}
inline void encode(int kind, const float *src, uint16_t *dst, int64_t n) {
  DISTEMB_HALF_DISPATCH(encode_t, src, dst, n);
}
inline void decode(int kind, const uint16_t *src, float *dst, int64_t n) {
  DISTEMB_HALF_DISPATCH(decode_t, src, dst, n);
}

// The float32 entry points (csrc/_kernels.pyx).
inline void gather_f32(const float *t, const int64_t *r, float *o, int64_t n, int64_t d,
                       int nt) {
  gather_t<F32Row>(t, r, o, n, d, nt);
}
template <class R>
inline void elementwise_f32(float *w, float *const *s, const int64_t *r, const float *g,
                            int64_t n, int64_t d, const typename R::Params &p, int nt) {
  elementwise_t<F32Row, R>(w, s, r, g, n, d, p, 0, nt);
}
inline void rowwise_adagrad_f32(float *w, float *s, const int64_t *r, const float *g,
                                int64_t n, int64_t d, float clr, float eps, int nt) {
  rowwise_adagrad_t<F32Row>(w, s, r, g, n, d, clr, eps, 0, nt);
}
inline void adam_f32(float *w, float *m, float *v, const int64_t *r, const float *g, int64_t n,
                     int64_t d, double lr, double b1, double b2, double eps, int64_t step,
                     int64_t *rs, int nt) {
  adam_t<F32Row>(w, m, v, r, g, n, d, lr, b1, b2, eps, step, rs, 0, nt);
}

// dedup_sum's two halves. The sort: ``order`` (n) gets the positions of ``ids`` in
// ascending id order, equal ids in batch order (stable); ``starts`` (n + 1) the first
// position in ``order`` of each distinct id and n after the last; ``*nu`` their number.
static const int RADIX_BITS = 11;

static inline int bit_length(uint64_t x) {
  int b = 0;
  for (; x; x >>= 1) ++b;
  return b;
}

// Stable LSD radix sort of ``keys`` on bits [lo_bit, hi_bit); the result in ``keys``.
static void radix_sort(uint64_t *keys, uint64_t *tmp, int64_t n, int lo_bit, int hi_bit) {
  std::vector<int64_t> counts(1 << RADIX_BITS);
  const uint64_t mask = (1u << RADIX_BITS) - 1;
  uint64_t *src = keys, *dst = tmp;
  for (int shift = lo_bit; shift < hi_bit; shift += RADIX_BITS) {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++counts[(src[i] >> shift) & mask];
    int64_t total = 0;
    for (auto &c : counts) {
      const int64_t k = c;
      c = total;
      total += k;
    }
    for (int64_t i = 0; i < n; ++i) dst[counts[(src[i] >> shift) & mask]++] = src[i];
    std::swap(src, dst);
  }
  if (src != keys) std::memcpy(keys, src, n * sizeof(uint64_t));
}

inline void dedup_order_into(const int64_t *ids, int64_t n, int64_t *order, int64_t *starts,
                             int64_t *nu) {
  int64_t count = 0;
  if (n) {
    int64_t lo = ids[0], hi = ids[0];
    for (int64_t i = 0; i < n; ++i) {
      lo = ids[i] < lo ? ids[i] : lo;
      hi = ids[i] > hi ? ids[i] : hi;
    }
    const int pos_bits = bit_length((uint64_t)n);
    const int id_bits = bit_length((uint64_t)hi - (uint64_t)lo);
    if (pos_bits + id_bits <= 64) {
      // One key per id: (id - lo) above its position. LSD radix on the id bits only is
      // stable, so equal ids keep batch order: the sums are deterministic.
      std::vector<uint64_t> keys(n), tmp(n);
      for (int64_t i = 0; i < n; ++i)
        keys[i] = (((uint64_t)ids[i] - (uint64_t)lo) << pos_bits) | (uint64_t)i;
      radix_sort(keys.data(), tmp.data(), n, pos_bits, pos_bits + id_bits);
      const uint64_t pos_mask = pos_bits == 64 ? ~0ull : (1ull << pos_bits) - 1;
      for (int64_t i = 0; i < n; ++i) {
        order[i] = (int64_t)(keys[i] & pos_mask);
        if (i == 0 || (keys[i] >> pos_bits) != (keys[i - 1] >> pos_bits)) starts[count++] = i;
      }
    } else {  // ids spanning nearly all of int64: compare (id, position) pairs
      std::vector<std::pair<int64_t, int64_t>> pairs(n);
      for (int64_t i = 0; i < n; ++i) pairs[i] = {ids[i], i};
      std::sort(pairs.begin(), pairs.end());
      for (int64_t i = 0; i < n; ++i) {
        order[i] = pairs[i].second;
        if (i == 0 || pairs[i].first != pairs[i - 1].first) starts[count++] = i;
      }
    }
  }
  starts[count] = n;
  *nu = count;
}

// The sums: uniq[k] = the k-th distinct id, out[k] = the sum of its gradient rows, in
// batch order (one thread per id: deterministic for any thread count). The rows are read
// in id order, at random in the gradient (a few MB, not in L1/L2): each read prefetches
// the row PREFETCH_AHEAD positions later in that order, so several misses are in flight.
inline void segment_sum(const int64_t *ids, const float *g, int64_t d, const int64_t *order,
                        const int64_t *starts, int64_t nu, int64_t *uniq, float *out, int nt) {
  const int64_t n = starts[nu];
#pragma omp parallel for schedule(dynamic, CHUNK_ROWS) num_threads(nt)
  for (int64_t k = 0; k < nu; ++k) {
    uniq[k] = ids[order[starts[k]]];
    float *dst = out + k * d;
    for (int64_t seg = starts[k]; seg < starts[k + 1]; ++seg) {
      if (seg + PREFETCH_AHEAD < n)
        prefetch(g + order[seg + PREFETCH_AHEAD] * d, d * sizeof(float), false);
      const float *src = g + order[seg] * d;
      if (seg == starts[k]) {
        std::memcpy(dst, src, d * sizeof(float));
      } else {
        for (int64_t j = 0; j < d; ++j) dst[j] = dst[j] + src[j];
      }
    }
  }
}
