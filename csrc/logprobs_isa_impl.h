// The row kernels of logprobs_isa.h, written once against a small vector type `Vec` that each ISA file
// defines (inside its own namespace) before including this file. Not a standalone header: no include guard,
// no includes (see logprobs_isa.h for why).
//
// Vec must provide: F (a vector of W floats), W, set1, load(const float*/F16*), store(float*/F16*, F),
// load2(const Bf16*, F&, F&) and store2(Bf16*, F, F) (2W bfloat16 values as two vectors, in any order of lanes
// that store2 undoes: the AVX kernels split even and odd elements, which costs one integer operation per
// vector instead of a widening shuffle and a shift), add, mul, fmadd(a, b, c) = a * b + c, max(a, b) (returns
// b when either is NaN, like maxps), round (to nearest even), ldexp_unless_below(y, n, x, c) (y * 2^n for
// integral n >= -126 where x >= c or x is NaN, and 0 where x < c; n may be anything in the zeroed lanes),
// hsum, hmax.

// exp(x) for x <= 88, vectorised: Cody-Waite reduction x = n ln2 + r (|r| <= ln2 / 2), a degree-6
// polynomial for exp(r) in Horner form (coefficients fitted to exp's relative error on [-ln2/2, ln2/2],
// 2e-9 before float32 rounding), then the scaling by 2^n (one instruction on AVX-512: scalef). At most 2
// float32 ulps from float64 (the tests check every ISA over [-87.3, 0]); x < -87.3 gives exactly 0 (so -inf
// gives 0); NaN stays NaN. No clamp: below -87.3 the lane is zeroed whatever n is, and every caller passes
// x <= 0 up to one rounding (z - max z, or log p). 12 vector operations (AVX-512), of which 9 are FMAs or
// multiplies.
static inline __attribute__((always_inline)) F vexp(F x) {
  const F n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  F r = Vec::fmadd(n, Vec::set1(-0.693359375f), x);  // n * 0.693359375 is exact: no FMA needed for it
  r = Vec::fmadd(n, Vec::set1(2.12194440e-4f), r);
  F p = Vec::set1(1.3843652559444308e-3f);
  p = Vec::fmadd(p, r, Vec::set1(8.37415549904108e-3f));
  p = Vec::fmadd(p, r, Vec::set1(4.166800156235695e-2f));
  p = Vec::fmadd(p, r, Vec::set1(1.6666431725025177e-1f));
  p = Vec::fmadd(p, r, Vec::set1(4.999999403953552e-1f));
  p = Vec::fmadd(p, r, Vec::set1(1.0f));
  p = Vec::fmadd(p, r, Vec::set1(1.0f));
  return Vec::ldexp_unless_below(p, n, x, Vec::set1(-87.3f));
}

// exp(x) for the gradient of bfloat16 and float16 logits, which is rounded to 8 or 11 significant bits
// right after: one-constant reduction and a degree-4 polynomial (fitted like vexp's), 2.9e-6 relative error
// (1/700 of a bfloat16 half-ulp, 1/170 of a float16 one; the tests bound it). Same range and special values
// as vexp; 9 vector operations (AVX-512).
static inline __attribute__((always_inline)) F vexp_narrow(F x) {
  const F n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  const F r = Vec::fmadd(n, Vec::set1(-0.693147180559945309f), x);
  F p = Vec::set1(4.151369631290436e-2f);
  p = Vec::fmadd(p, r, Vec::set1(1.6787457466125488e-1f));
  p = Vec::fmadd(p, r, Vec::set1(5.000301599502563e-1f));
  p = Vec::fmadd(p, r, Vec::set1(9.999668598175049e-1f));
  p = Vec::fmadd(p, r, Vec::set1(1.0f));
  return Vec::ldexp_unless_below(p, n, x, Vec::set1(-87.3f));
}

// Whether logits of type T get a narrow (bfloat16 / float16) gradient.
template <typename T>
struct NarrowGrad {
  static constexpr bool value = true;
};
template <>
struct NarrowGrad<float> {
  static constexpr bool value = false;
};

// 2W values of each storage type as two vectors: float32 and float16 in order, bfloat16 in the ISA's own lane
// order (Vec::load2), undone by store2 (the non-template overloads win for Bf16).
template <typename T>
static inline __attribute__((always_inline)) void load2(const T* p, F& a, F& b) {
  a = Vec::load(p);
  b = Vec::load(p + W);
}
static inline __attribute__((always_inline)) void load2(const Bf16* p, F& a, F& b) { Vec::load2(p, a, b); }
template <typename T>
static inline __attribute__((always_inline)) void store2(T* p, F a, F b) {
  Vec::store(p, a);
  Vec::store(p + W, b);
}
static inline __attribute__((always_inline)) void store2(Bf16* p, F a, F b) { Vec::store2(p, a, b); }

static constexpr int64_t kChunk = 2048;  // elements per chunk: 8 KB of float32, stays in L1 between passes

// Negative infinity in each storage type (tail padding contributes nothing to a max or an exp-sum).
static inline void set_neg_inf(float* p) { *p = -__builtin_inff(); }
static inline void set_neg_inf(Bf16* p) { p->bits = 0xFF80u; }
static inline void set_neg_inf(F16* p) { p->bits = 0xFC00u; }

// The last n < 2W values of a row as a full block of 2W, padded with -inf (which adds nothing to a max or an
// exp-sum, and whose gradient is 0).
template <typename T>
static inline __attribute__((always_inline)) void load2_tail(const T* x, int64_t n, T* pad, F& a, F& b) {
  for (int k = 0; k < 2 * W; ++k) set_neg_inf(pad + k);
  for (int64_t k = 0; k < n; ++k) pad[k] = x[k];
  load2(pad, a, b);
}

// Max of x[0..n) (NaN ignored: the exp-sum carries NaN into the result instead).
template <typename T>
static inline __attribute__((always_inline)) float chunk_max(const T* x, int64_t n) {
  F m0 = Vec::set1(-__builtin_inff()), m1 = m0;
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    F a, b;
    load2(x + i, a, b);
    m0 = Vec::max(a, m0);
    m1 = Vec::max(b, m1);
  }
  if (i < n) {
    T pad[2 * W];
    F a, b;
    load2_tail(x + i, n - i, pad, a, b);
    m0 = Vec::max(a, m0);
    m1 = Vec::max(b, m1);
  }
  return Vec::hmax(Vec::max(m0, m1));
}

// sum exp(z - m) and (kEnt) sum exp(z - m) (z - m) over x[0..n), z = x * it, in float lanes.
// (z - m) is clamped at -100 for the second sum: exp is 0 there, and 0 * -inf would be NaN.
template <bool kEnt>
static inline __attribute__((always_inline)) void sums_step(F a, F b, F it, F neg_m, F& s0, F& s1, F& w0, F& w1) {
  const F d0 = Vec::fmadd(a, it, neg_m), d1 = Vec::fmadd(b, it, neg_m);
  const F e0 = vexp(d0), e1 = vexp(d1);
  s0 = Vec::add(s0, e0);
  s1 = Vec::add(s1, e1);
  if (kEnt) {
    const F lo = Vec::set1(-100.0f);
    w0 = Vec::fmadd(e0, Vec::max(lo, d0), w0);
    w1 = Vec::fmadd(e1, Vec::max(lo, d1), w1);
  }
}

template <typename T, bool kEnt>
static inline __attribute__((always_inline)) void chunk_sums(const T* x, int64_t n, F it, F neg_m, float* s_out,
                                                             float* w_out) {
  F s0 = Vec::set1(0.0f), s1 = s0, w0 = s0, w1 = s0;
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    F a, b;
    load2(x + i, a, b);
    sums_step<kEnt>(a, b, it, neg_m, s0, s1, w0, w1);
  }
  if (i < n) {
    T pad[2 * W];
    F a, b;
    load2_tail(x + i, n - i, pad, a, b);
    sums_step<kEnt>(a, b, it, neg_m, s0, s1, w0, w1);
  }
  *s_out = Vec::hsum(Vec::add(s0, s1));
  *w_out = kEnt ? Vec::hsum(Vec::add(w0, w1)) : 0.0f;
}

template <typename T, bool kEnt>
static void row_stats(const T* x, int64_t n, float it, float* out) {
  const float ninf = -__builtin_inff();
  float m = ninf;           // running max of z
  double s = 0.0, w = 0.0;  // sums relative to m (relative to 0 while m == -inf)
  const F itv = Vec::set1(it);
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = n - c0 < kChunk ? n - c0 : kChunk;
    const T* p = x + c0;
    // max(x) * it == max(x * it): rounding is monotone and it > 0.
    const float cm = chunk_max(p, len) * it;
    if (cm > m) {
      if (m == ninf) {  // the sums so far were of exp(-inf or NaN): 0 or NaN, kept as such
        s *= 0.0;
        w *= 0.0;
      } else {
        const double a = exp_double(static_cast<double>(m) - static_cast<double>(cm));
        w = a * (w + (static_cast<double>(m) - static_cast<double>(cm)) * s);
        s *= a;
      }
      m = cm;
    }
    float sc, wc;
    chunk_sums<T, kEnt>(p, len, itv, Vec::set1(m == ninf ? 0.0f : -m), &sc, &wc);
    s += sc;
    w += wc;
  }
  out[0] = m;
  out[1] = static_cast<float>(s);
  out[2] = static_cast<float>(w);
}

template <typename T, bool kEnt>
static inline __attribute__((always_inline)) F grad_vec(F v, F it, F neg_lse, F cg, F cgh, F h) {
  const F lp = Vec::fmadd(v, it, neg_lse);
  const F p = NarrowGrad<T>::value ? vexp_narrow(lp) : vexp(lp);
  // it * p * (-g - gh (lp + h)) = p * (cg + cgh (lp + h)), cg = -g it, cgh = -gh it
  return kEnt ? Vec::mul(p, Vec::fmadd(cgh, Vec::add(lp, h), cg)) : Vec::mul(p, cg);
}

template <typename T, bool kEnt>
static void row_grad(const T* x, T* dx, int64_t n, float it, float lse, float g, float h, float gh) {
  const F itv = Vec::set1(it), nl = Vec::set1(-lse), cg = Vec::set1(-g * it), cgh = Vec::set1(-gh * it);
  const F hv = Vec::set1(h);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {  // load both before storing: dx may alias x
    F a, b;
    load2(x + i, a, b);
    store2(dx + i, grad_vec<T, kEnt>(a, itv, nl, cg, cgh, hv), grad_vec<T, kEnt>(b, itv, nl, cg, cgh, hv));
  }
  if (i < n) {
    T pad[2 * W];
    F a, b;
    load2_tail(x + i, n - i, pad, a, b);
    store2(pad, grad_vec<T, kEnt>(a, itv, nl, cg, cgh, hv), grad_vec<T, kEnt>(b, itv, nl, cg, cgh, hv));
    for (int64_t k = 0; k < n - i; ++k) dx[i + k] = pad[k];
  }
}

template <typename T>
static constexpr RowKernelsFor<T> kernels_for() {
  return {&row_stats<T, false>, &row_stats<T, true>, &row_grad<T, false>, &row_grad<T, true>};
}
