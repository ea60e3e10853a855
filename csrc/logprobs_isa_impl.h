// The row kernels of logprobs_isa.h, written once against a small vector type `Vec` that each ISA file
// defines (inside its own namespace) before including this file. Not a standalone header: no include guard,
// no includes (see logprobs_isa.h for why).
//
// Vec must provide: F (a vector of W floats), W, set1, load(const float*/F16*), store(float*/F16*, F),
// load2(const Bf16*, F&, F&) and store2(Bf16*, F, F) (2W bfloat16 values as two vectors, in any order of lanes
// that store2 undoes: the AVX kernels split even and odd elements, which costs one integer operation per
// vector instead of a widening shuffle and a shift), add, sub, mul, fmadd(a, b, c) = a * b + c, max(a, b)
// (returns b when either is NaN, like maxps), round (to nearest even), ldexp_unless_below(y, n, x, c) (y * 2^n
// for integral n >= -126 where x >= c or x is NaN, and 0 where x < c; n may be anything in the zeroed lanes),
// pow2_shifted(t) (2^n where t = n + 1.5 * 2^23 + 127, n integral in [-127, 127]: the low 9 bits of t's bits
// shifted into the exponent field; n = -127 gives exactly 0), hsum, hmax; and for the bfloat16 max, a vector
// I16 of 2W signed 16-bit integers with i16_set1, i16_load(const Bf16*), i16_max, i16_min, i16_hmax, i16_hmin.

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

// 2^d for the forward's sums, d in [-127, 127] or NaN (the caller clamps d below at -127 with max, which keeps
// NaN): the shifter trick rounds d to n = round(d) with one add (t = d + 1.5 * 2^23 + 127 holds n + 127 in its
// low mantissa bits), r = d - n exactly, a degree-6 polynomial for 2^r on [-1/2, 1/2] (coefficients fitted to
// its relative error, 1.6e-8 before float32 rounding) and the scaling by 2^n from t's bits (n = -127 gives
// exactly 0, so do d <= -126.5 and d = -inf after the clamp; NaN stays NaN), returned as the two factors p
// (the polynomial) and s (2^n) so that a sum can take their product in its FMA. At most 2 float32 ulps from
// float64 (tests/ops: the forward's sums against float64). 10 vector operations, of which 6 are FMAs: the
// rounding is 2 additions instead of a round, a multiply and two FMAs, and there is no conversion to integers
// and no compare. The forward works in log2 units (z * log2(e)): the multiply by log2(e) is folded into the
// scale of the logits.
static inline __attribute__((always_inline)) void vexp2(F d, F& p, F& s) {
  const F shift = Vec::set1(12583039.0f);  // 1.5 * 2^23 + 127
  const F t = Vec::add(d, shift);
  const F r = Vec::sub(d, Vec::sub(t, shift));
  p = Vec::set1(1.5345794963650405e-4f);
  p = Vec::fmadd(p, r, Vec::set1(1.3399932067841291e-3f));
  p = Vec::fmadd(p, r, Vec::set1(9.618489071726799e-3f));
  p = Vec::fmadd(p, r, Vec::set1(5.550328642129898e-2f));
  p = Vec::fmadd(p, r, Vec::set1(2.4022646248340607e-1f));
  p = Vec::fmadd(p, r, Vec::set1(6.931471824645996e-1f));
  p = Vec::fmadd(p, r, Vec::set1(1.0f));
  s = Vec::pow2_shifted(t);
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

// The same for bfloat16 with 2 integer operations per 2W values instead of 4 (two conversions, two maxima):
// bfloat16 bits read as signed 16-bit integers order the non-negative values by value, and the negative ones
// (sign bit set: negative integers) by magnitude. So the largest integer is the largest value when it is >= 0
// (some value is +0 or above), and otherwise the smallest integer is: the negative value of least magnitude.
// Only NaN breaks the order (+NaN is above +inf; -NaN above every other negative, so never the smallest):
// when the chosen value is NaN, the float max above is taken instead, which ignores NaN.
static inline float chunk_max(const Bf16* x, int64_t n) {
  Vec::I16 hi = Vec::i16_set1(-32768), lo = Vec::i16_set1(32767);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const Vec::I16 v = Vec::i16_load(x + i);
    hi = Vec::i16_max(hi, v);
    lo = Vec::i16_min(lo, v);
  }
  if (i < n) {
    Bf16 pad[2 * W];
    for (int k = 0; k < 2 * W; ++k) set_neg_inf(pad + k);  // -inf: the negative value of largest magnitude
    for (int64_t k = 0; k < n - i; ++k) pad[k] = x[i + k];
    const Vec::I16 v = Vec::i16_load(pad);
    hi = Vec::i16_max(hi, v);
    lo = Vec::i16_min(lo, v);
  }
  const int16_t mh = Vec::i16_hmax(hi), ml = Vec::i16_hmin(lo);
  const uint32_t bits = static_cast<uint32_t>(static_cast<uint16_t>(mh >= 0 ? mh : ml)) << 16;
  float m;
  __builtin_memcpy(&m, &bits, sizeof m);
  return m == m ? m : chunk_max<Bf16>(x, n);
}

// sum 2^d and (kEnt) sum 2^d d over x[0..n), in float lanes, with d = x c - mc (log2 units: c = it log2(e),
// mc = fl(mx c), mx = max x; `off` = -mc), or with kSub d = (x - mx) c (`off` = mx: one more operation, for
// rows whose |mx c| is so large that mc's rounding is not small, see row_stats). d is clamped below at -127,
// where 2^d is exactly 0 (so -inf padding adds 0, and 0 * d is never 0 * -inf).
template <bool kEnt, bool kSub>
static inline __attribute__((always_inline)) void sums_step(F a, F b, F c, F off, F& s0, F& s1, F& w0, F& w1) {
  const F lo = Vec::set1(-127.0f);
  const F d0 = Vec::max(lo, kSub ? Vec::mul(Vec::sub(a, off), c) : Vec::fmadd(a, c, off));
  const F d1 = Vec::max(lo, kSub ? Vec::mul(Vec::sub(b, off), c) : Vec::fmadd(b, c, off));
  F p0, p1, k0, k1;
  vexp2(d0, p0, k0);
  vexp2(d1, p1, k1);
  if (kEnt) {
    const F e0 = Vec::mul(p0, k0), e1 = Vec::mul(p1, k1);
    s0 = Vec::add(s0, e0);
    s1 = Vec::add(s1, e1);
    w0 = Vec::fmadd(e0, d0, w0);
    w1 = Vec::fmadd(e1, d1, w1);
  } else {
    s0 = Vec::fmadd(p0, k0, s0);
    s1 = Vec::fmadd(p1, k1, s1);
  }
}

template <typename T, bool kEnt, bool kSub>
static inline __attribute__((always_inline)) void chunk_sums(const T* x, int64_t n, F c, F off, float* s_out,
                                                             float* w_out) {
  F s0 = Vec::set1(0.0f), s1 = s0, w0 = s0, w1 = s0;
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    F a, b;
    load2(x + i, a, b);
    sums_step<kEnt, kSub>(a, b, c, off, s0, s1, w0, w1);
  }
  if (i < n) {
    T pad[2 * W];
    F a, b;
    load2_tail(x + i, n - i, pad, a, b);
    sums_step<kEnt, kSub>(a, b, c, off, s0, s1, w0, w1);
  }
  *s_out = Vec::hsum(Vec::add(s0, s1));
  *w_out = kEnt ? Vec::hsum(Vec::add(w0, w1)) : 0.0f;
}

// The vector loop sums 2^(x c - mc) with c = fl(it log2 e) and mc = fl(mx c) (mx the running max of the raw
// logits); the row's statistics are relative to m = fl(mx it), in natural units. Per value of mx, in double:
// e = mx c - mc and rho = mx it - m (both exact: a product of two floats fits a double), and a chunk's sums
// S2 = sum 2^d, W2 = sum 2^d d convert as
//   sum exp(z - m)         = K S2,                              K = 2^-e e^rho,
//   sum exp(z - m) (z - m) = K ((it / c) (W2 - e S2) + rho S2)   (z - m = (d - e) it / c + rho).
// it / c = ln 2 up to c's rounding (relative 6e-8 of d, which changes no sum by more than 3e-8).
// Where |mc| >= 2^20, e (up to half an ulp of mc) is no longer small: 2^d of the max itself would be 2^e, which
// can overflow (logits of -1e30 as a mask, say). Such rows take the kSub loop, d = (x - mx) c, with e = 0.
struct Log2Shift {
  float off;  // the vector loop's offset: -mc, or mx with sub (0 while mx = -inf: every value is -inf or NaN)
  bool sub;
  double e, rho, k;
};

static inline Log2Shift log2_shift(float mx, float m, float c, float it) {
  if (mx == -__builtin_inff()) return {0.0f, false, 0.0, 0.0, 1.0};
  const float mc = mx * c;
  const double rho = static_cast<double>(mx) * it - m;
  if (!(mc > -1048576.0f && mc < 1048576.0f)) return {mx, true, 0.0, rho, exp_double(rho)};  // NaN at +inf
  const double e = static_cast<double>(mx) * c - mc;
  return {-mc, false, e, rho, exp_double(rho - e * 0.69314718055994531)};
}

template <typename T, bool kEnt>
static void row_stats(const T* x, int64_t n, float it, float* out) {
  const float ninf = -__builtin_inff();
  const float c = static_cast<float>(static_cast<double>(it) * 1.4426950408889634);  // it log2(e)
  const double it_over_c = static_cast<double>(it) / c;
  float mx = ninf;          // running max of the raw logits (NaN ignored: the sums carry it)
  float m = ninf;           // running max of z = x * it: fl(mx * it), as the output reports it
  double s = 0.0, w = 0.0;  // sums relative to m (relative to 0 while m == -inf)
  Log2Shift sh = log2_shift(mx, m, c, it);
  const F cv = Vec::set1(c);
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = n - c0 < kChunk ? n - c0 : kChunk;
    const T* p = x + c0;
    const float cmx = chunk_max(p, len);
    if (cmx > mx) {
      // max(x) * it == max(x * it): rounding is monotone and it > 0.
      const float cm = cmx * it;
      if (m == ninf) {  // the sums so far were of exp(-inf or NaN): 0 or NaN, kept as such
        s *= 0.0;
        w *= 0.0;
      } else if (cm > m) {
        const double a = exp_double(static_cast<double>(m) - static_cast<double>(cm));
        if (kEnt) w = a * (w + (static_cast<double>(m) - static_cast<double>(cm)) * s);
        s *= a;
      }
      mx = cmx;
      m = cm;
      sh = log2_shift(mx, m, c, it);
    }
    float s2, w2;
    if (sh.sub)
      chunk_sums<T, kEnt, true>(p, len, cv, Vec::set1(sh.off), &s2, &w2);
    else
      chunk_sums<T, kEnt, false>(p, len, cv, Vec::set1(sh.off), &s2, &w2);
    s += sh.k * s2;
    if (kEnt) w += sh.k * (it_over_c * (w2 - sh.e * s2) + sh.rho * s2);
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
