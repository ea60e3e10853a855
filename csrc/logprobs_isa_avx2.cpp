// The log-prob row kernels (logprobs_isa_impl.h) for AVX2 + FMA + F16C: 8 floats per vector.
// Compiled for that instruction set; chosen at run time only on CPUs that have it (see logprobs_isa.h).
#include "logprobs_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace gspo {
namespace cpu {
namespace isa_avx2 {

using F = __m256;
constexpr int W = 8;

struct Vec {
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // 16 bfloat16 values: a = the even elements, b = the odd ones (one AND or shift each; no shuffle).
  static void load2(const Bf16* p, F& a, F& b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // v rounded to bfloat16 (nearest even), the result in the upper 16 bits of each lane; NaN gives 0x7FC0.
  static __m256i bf16_bits(F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
  }
  // the inverse of load2: even elements from a, odd ones from b
  static void store2(Bf16* p, F a, F b) {
    const __m256i lo = _mm256_srli_epi32(bf16_bits(a), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_blend_epi16(lo, bf16_bits(b), 0xAA));
  }
  static void store(F16* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F exp2i(F n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
  }
  static F and_not_lt(F x, F c, F y) { return _mm256_andnot_ps(_mm256_cmp_ps(x, c, _CMP_LT_OQ), y); }
  static F ldexp_unless_below(F y, F n, F x, F c) { return and_not_lt(x, c, mul(y, exp2i(n))); }
  static F pow2_shifted(F t) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)); }
  // 2W bfloat16 values as signed 16-bit integers (their bits)
  using I16 = __m256i;
  static I16 i16_set1(int16_t v) { return _mm256_set1_epi16(v); }
  static I16 i16_load(const Bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static int16_t h128(__m128i v, bool mx) {  // the max (mx) or min of 8 signed 16-bit lanes
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 8)) : _mm_min_epi16(v, _mm_srli_si128(v, 8));
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 4)) : _mm_min_epi16(v, _mm_srli_si128(v, 4));
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 2)) : _mm_min_epi16(v, _mm_srli_si128(v, 2));
    return static_cast<int16_t>(_mm_extract_epi16(v, 0));
  }
  static int16_t i16_hmax(I16 v) {
    return h128(_mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)), true);
  }
  static int16_t i16_hmin(I16 v) {
    return h128(_mm_min_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)), false);
  }
  static I16 i16_max(I16 a, I16 b) { return _mm256_max_epi16(a, b); }
  static I16 i16_min(I16 a, I16 b) { return _mm256_min_epi16(a, b); }
  static float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hmax(F a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
};

#include "logprobs_isa_impl.h"

}  // namespace isa_avx2

extern const RowKernels kRowKernelsAvx2 = {isa_avx2::kernels_for<float>(), isa_avx2::kernels_for<Bf16>(),
                                           isa_avx2::kernels_for<F16>()};

}  // namespace cpu
}  // namespace gspo
#endif
