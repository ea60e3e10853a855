// The log-prob row kernels (logprobs_isa_impl.h) for AVX-512 (F, BW, VL, DQ) + FMA + F16C: 16 floats per
// vector. Compiled for that instruction set; chosen at run time only on CPUs that have it (see logprobs_isa.h).
#include "logprobs_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

namespace gspo {
namespace cpu {
namespace isa_avx512 {

using F = __m512;
constexpr int W = 16;

struct Vec {
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // 32 bfloat16 values: a = the even elements, b = the odd ones (one AND or shift each; no shuffle).
  static void load2(const Bf16* p, F& a, F& b) {
    const __m512i v = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // v rounded to bfloat16 (nearest even), the result in the upper 16 bits of each lane; NaN gives 0x7FC0.
  static __m512i bf16_bits(F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  }
  // the inverse of load2: even elements from a, odd ones from b
  static void store2(Bf16* p, F a, F b) {
    const __m512i lo = _mm512_srli_epi32(bf16_bits(a), 16);
    _mm512_storeu_si512(p, _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, bf16_bits(b)));
  }
  static void store(F16* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // scalef: y * 2^n in one instruction; lanes where x < c (ordered) are zeroed by the mask.
  static F ldexp_unless_below(F y, F n, F x, F c) {
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, c, _CMP_NLT_UQ), y, n);
  }
  static F pow2_shifted(F t) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23)); }
  // 2W bfloat16 values as signed 16-bit integers (their bits)
  using I16 = __m512i;
  static I16 i16_set1(int16_t v) { return _mm512_set1_epi16(v); }
  static I16 i16_load(const Bf16* p) { return _mm512_loadu_si512(p); }
  static int16_t h128(__m128i v, bool mx) {  // the max (mx) or min of 8 signed 16-bit lanes
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 8)) : _mm_min_epi16(v, _mm_srli_si128(v, 8));
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 4)) : _mm_min_epi16(v, _mm_srli_si128(v, 4));
    v = mx ? _mm_max_epi16(v, _mm_srli_si128(v, 2)) : _mm_min_epi16(v, _mm_srli_si128(v, 2));
    return static_cast<int16_t>(_mm_extract_epi16(v, 0));
  }
  static int16_t i16_hmax(I16 v) {
    const __m256i h = _mm256_max_epi16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return h128(_mm_max_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)), true);
  }
  static int16_t i16_hmin(I16 v) {
    const __m256i h = _mm256_min_epi16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return h128(_mm_min_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)), false);
  }
  static I16 i16_max(I16 a, I16 b) { return _mm512_max_epi16(a, b); }
  static I16 i16_min(I16 a, I16 b) { return _mm512_min_epi16(a, b); }
  static float hsum(F a) {
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 h = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hmax(F a) {
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 h = _mm256_max_ps(lo, hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
};

#include "logprobs_isa_impl.h"

}  // namespace isa_avx512

extern const RowKernels kRowKernelsAvx512 = {isa_avx512::kernels_for<float>(), isa_avx512::kernels_for<Bf16>(),
                                             isa_avx512::kernels_for<F16>()};

// The same kernels with the bfloat16 gradient rounded by AVX512_BF16's conversion instruction (Zen 4 and
// later, Cooper Lake and Sapphire Rapids and later): one instruction and one word permute per 32 values
// instead of about 14 integer operations. The one difference in results: the instruction rounds a float32
// gradient element below 2^-126 (1.2e-38) to zero instead of to a bfloat16 subnormal. Only the bfloat16
// entries differ from kRowKernelsAvx512.
#pragma GCC push_options
#pragma GCC target("avx512bf16")

namespace isa_avx512_bf16 {

using F = __m512;
constexpr int W = 16;

struct Vec : isa_avx512::Vec {
  // the inverse of load2 (even elements from a, odd ones from b), rounded to nearest even by the instruction
  static void store2(Bf16* p, F a, F b) {
    // cvtne2ps packs b's 16 values in the low half and a's in the high half; the permute interleaves them
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(a, b));
    const __m512i idx = _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24, 7, 23, 6, 22,
                                         5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(idx, packed));
  }
};

#include "logprobs_isa_impl.h"

}  // namespace isa_avx512_bf16

#pragma GCC pop_options

extern const RowKernels kRowKernelsAvx512Bf16 = {isa_avx512::kernels_for<float>(),
                                                 isa_avx512_bf16::kernels_for<Bf16>(),
                                                 isa_avx512::kernels_for<F16>()};

}  // namespace cpu
}  // namespace gspo
#endif
