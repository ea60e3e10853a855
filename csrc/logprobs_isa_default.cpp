// The log-prob row kernels (logprobs_isa_impl.h) for baseline x86-64 (SSE2): 4 floats per vector, no FMA
// (a * b + c rounds twice), float16 converted lane by lane. On other architectures the same code runs on a
// plain 4-float struct that the compiler may vectorise.
#include "logprobs_isa.h"

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define GSPO_SSE2 1
#endif

namespace gspo {
namespace cpu {
namespace isa_default {

namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
}

// IEEE binary16 -> binary32, exact (normals, subnormals, inf, NaN).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
  return bits_to_float(sign | float_to_bits(mag));
}

// binary32 -> binary16, round to nearest even; overflow to inf, NaN to a quiet NaN.
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal, round man * 2^24
    const float scaled = bits_to_float(a) * 16777216.0f;  // exact
    // round half to even via the 1.5 * 2^23 trick (0 <= scaled < 1024)
    const float r = (scaled + 12582912.0f) - 12582912.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  const uint32_t lsb = (a >> 13) & 1u;
  const uint32_t rounded = a + 0xFFFu + lsb;
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace

constexpr int W = 4;

#ifdef GSPO_SSE2
using F = __m128;

struct Vec {
  static F set1(float v) { return _mm_set1_ps(v); }
  static F load(const float* p) { return _mm_loadu_ps(p); }
  static F load(const F16* p) {
    return _mm_setr_ps(half_to_float(p[0].bits), half_to_float(p[1].bits), half_to_float(p[2].bits),
                       half_to_float(p[3].bits));
  }
  // 8 bfloat16 values, in order: two unpacks of one load
  static void load2(const Bf16* p, F& a, F& b) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a = _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
    b = _mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), h));
  }
  static void store2(Bf16* p, F a, F b) {
    store(p, a);
    store(p + 4, b);
  }
  static void store(float* p, F v) { _mm_storeu_ps(p, v); }
  static void store(Bf16* p, F v) {
    const __m128i u = _mm_castps_si128(v);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7FFF)), lsb), 16);
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
    r = _mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, _mm_set1_epi32(0x7FC0)));
    // r < 2^16: sign-extend the low 16 bits so that the signed pack keeps the bit pattern exactly
    r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(r, r));
  }
  static void store(F16* p, F v) {
    float t[4];
    _mm_storeu_ps(t, v);
    for (int k = 0; k < 4; ++k) p[k].bits = float_to_half(t[k]);
  }
  static F add(F a, F b) { return _mm_add_ps(a, b); }
  static F sub(F a, F b) { return _mm_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
  static F max(F a, F b) { return _mm_max_ps(a, b); }
  // nearest even under the default MXCSR rounding mode (|a| < 2^31 here)
  static F round(F a) { return _mm_cvtepi32_ps(_mm_cvtps_epi32(a)); }
  static F exp2i(F n) {
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23));
  }
  static F and_not_lt(F x, F c, F y) { return _mm_andnot_ps(_mm_cmplt_ps(x, c), y); }
  static F ldexp_unless_below(F y, F n, F x, F c) { return and_not_lt(x, c, mul(y, exp2i(n))); }
  static F pow2_shifted(F t) { return _mm_castsi128_ps(_mm_slli_epi32(_mm_castps_si128(t), 23)); }
  // 2W bfloat16 values as signed 16-bit integers (their bits)
  using I16 = __m128i;
  static I16 i16_set1(int16_t v) { return _mm_set1_epi16(v); }
  static I16 i16_load(const Bf16* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static int16_t h128(__m128i v, bool mx) {  // the max (mx) or min of 8 signed 16-bit lanes
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 8)) : _mm_min_epi16(v, _mm_srli_si128(v, 8));
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 4)) : _mm_min_epi16(v, _mm_srli_si128(v, 4));
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 2)) : _mm_min_epi16(v, _mm_srli_si128(v, 2));
    return static_cast<int16_t>(_mm_extract_epi16(v, 0));
  }
  static int16_t i16_hmax(I16 v) { return h128(v, true); }
  static int16_t i16_hmin(I16 v) { return h128(v, false); }
  static I16 i16_max(I16 a, I16 b) { return _mm_max_epi16(a, b); }
  static I16 i16_min(I16 a, I16 b) { return _mm_min_epi16(a, b); }
  static float hsum(F a) {
    __m128 s = _mm_add_ps(a, _mm_movehl_ps(a, a));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hmax(F a) {
    __m128 s = _mm_max_ps(a, _mm_movehl_ps(a, a));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
};
#else
struct F {
  float v[4];
};

struct Vec {
  static F set1(float x) { return {{x, x, x, x}}; }
  static F load(const float* p) { return {{p[0], p[1], p[2], p[3]}}; }
  static F load(const Bf16* p) {
    F r;
    for (int k = 0; k < 4; ++k) r.v[k] = bits_to_float(static_cast<uint32_t>(p[k].bits) << 16);
    return r;
  }
  static F load(const F16* p) {
    F r;
    for (int k = 0; k < 4; ++k) r.v[k] = half_to_float(p[k].bits);
    return r;
  }
  static void load2(const Bf16* p, F& a, F& b) {
    a = load(p);
    b = load(p + 4);
  }
  static void store2(Bf16* p, F a, F b) {
    store(p, a);
    store(p + 4, b);
  }
  static void store(float* p, F a) {
    for (int k = 0; k < 4; ++k) p[k] = a.v[k];
  }
  static void store(Bf16* p, F a) {
    for (int k = 0; k < 4; ++k) {
      const uint32_t u = float_to_bits(a.v[k]);
      const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
      p[k].bits = static_cast<uint16_t>(a.v[k] != a.v[k] ? 0x7FC0u : r);
    }
  }
  static void store(F16* p, F a) {
    for (int k = 0; k < 4; ++k) p[k].bits = float_to_half(a.v[k]);
  }
#define GSPO_LANES(EXPR) \
  F r;                   \
  for (int k = 0; k < 4; ++k) r.v[k] = (EXPR); \
  return r;
  static F add(F a, F b) { GSPO_LANES(a.v[k] + b.v[k]) }
  static F sub(F a, F b) { GSPO_LANES(a.v[k] - b.v[k]) }
  static F mul(F a, F b) { GSPO_LANES(a.v[k] * b.v[k]) }
  static F fmadd(F a, F b, F c) { GSPO_LANES(a.v[k] * b.v[k] + c.v[k]) }
  static F max(F a, F b) { GSPO_LANES(a.v[k] > b.v[k] ? a.v[k] : b.v[k]) }
  static F round(F a) { GSPO_LANES((a.v[k] + 12582912.0f) - 12582912.0f) }
  // n outside [-127, 128] (or NaN) only reaches lanes that ldexp_unless_below zeroes or that are NaN: it is
  // replaced before the conversion, which would be undefined
  static F exp2i(F n) {
    GSPO_LANES(bits_to_float(
        static_cast<uint32_t>(static_cast<int32_t>(n.v[k] >= -127.0f && n.v[k] <= 128.0f ? n.v[k] : -127.0f) + 127)
        << 23))
  }
  static F and_not_lt(F x, F c, F y) { GSPO_LANES(x.v[k] < c.v[k] ? 0.0f : y.v[k]) }
  static F pow2_shifted(F t) { GSPO_LANES(bits_to_float(float_to_bits(t.v[k]) << 23)) }
#undef GSPO_LANES
  struct I16 {
    int16_t v[8];
  };
  static I16 i16_set1(int16_t x) {
    I16 r;
    for (int k = 0; k < 8; ++k) r.v[k] = x;
    return r;
  }
  static I16 i16_load(const Bf16* p) {
    I16 r;
    for (int k = 0; k < 8; ++k) r.v[k] = static_cast<int16_t>(p[k].bits);
    return r;
  }
  static int16_t i16_hmax(I16 a) {
    int16_t m = a.v[0];
    for (int k = 1; k < 8; ++k) m = a.v[k] > m ? a.v[k] : m;
    return m;
  }
  static int16_t i16_hmin(I16 a) {
    int16_t m = a.v[0];
    for (int k = 1; k < 8; ++k) m = a.v[k] < m ? a.v[k] : m;
    return m;
  }
  static I16 i16_max(I16 a, I16 b) {
    for (int k = 0; k < 8; ++k) a.v[k] = a.v[k] > b.v[k] ? a.v[k] : b.v[k];
    return a;
  }
  static I16 i16_min(I16 a, I16 b) {
    for (int k = 0; k < 8; ++k) a.v[k] = a.v[k] < b.v[k] ? a.v[k] : b.v[k];
    return a;
  }
  static F ldexp_unless_below(F y, F n, F x, F c) { return and_not_lt(x, c, mul(y, exp2i(n))); }
  static float hsum(F a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
  static float hmax(F a) {
    float m = a.v[0];
    for (int k = 1; k < 4; ++k) m = a.v[k] > m ? a.v[k] : m;
    return m;
  }
};
#endif

#include "logprobs_isa_impl.h"

}  // namespace isa_default

extern const RowKernels kRowKernelsDefault = {isa_default::kernels_for<float>(), isa_default::kernels_for<Bf16>(),
                                              isa_default::kernels_for<F16>()};

}  // namespace cpu
}  // namespace gspo
