// The row functions of rowops_body.h compiled for AVX-512, AVX2 and the baseline, and the choice between them at
// run time (the widest the CPU has). Used by rmsnorm_cpu.cpp, activation_cpu.cpp and softmax_cpu.cpp:
//   GSPO_ROWOP(fn, args...) calls rowops::<isa>::fn(args...) and has its value.
#pragma once
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <stdint.h>

#include <cmath>

#include "vec_math.h"

namespace gspo {
namespace rowops {

enum class Isa { kGeneric, kAvx2, kAvx512 };

inline Isa detect() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

inline Isa isa() {
  static const Isa chosen = detect();
  return chosen;
}

// Loads and stores of float32 / bfloat16 elements as plain bit operations (bfloat16: the upper half of a float32,
// stored rounded to nearest even, NaN as 0x7FC0, as c10::BFloat16 rounds), so that loops over them vectorise.
inline __attribute__((always_inline)) float ld(float v) { return v; }
inline __attribute__((always_inline)) float ld(c10::BFloat16 v) {
  return vecmath::bits_float(static_cast<uint32_t>(v.x) << 16);
}
inline __attribute__((always_inline)) void st(float* p, float v) { *p = v; }
inline __attribute__((always_inline)) void st(c10::BFloat16* p, float v) {
  uint32_t u;
  __builtin_memcpy(&u, &v, sizeof u);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  p->x = static_cast<uint16_t>(v != v ? 0x7FC0u : r);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define GSPO_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
namespace avx512 {
#include "rowops_body.h"
}  // namespace avx512
#undef GSPO_TARGET
#define GSPO_TARGET __attribute__((target("avx2,fma")))
namespace avx2 {
#include "rowops_body.h"
}  // namespace avx2
#undef GSPO_TARGET
#endif
#define GSPO_TARGET
namespace generic {
#include "rowops_body.h"
}  // namespace generic
#undef GSPO_TARGET

}  // namespace rowops
}  // namespace gspo

#if defined(__x86_64__) && defined(__GNUC__)
#define GSPO_ROWOP(fn, ...)                                                          \
  (::gspo::rowops::isa() == ::gspo::rowops::Isa::kAvx512 ? ::gspo::rowops::avx512::fn(__VA_ARGS__) \
   : ::gspo::rowops::isa() == ::gspo::rowops::Isa::kAvx2 ? ::gspo::rowops::avx2::fn(__VA_ARGS__)   \
                                                         : ::gspo::rowops::generic::fn(__VA_ARGS__))
#else
#define GSPO_ROWOP(fn, ...) ::gspo::rowops::generic::fn(__VA_ARGS__)
#endif

// AT_DISPATCH over the two element types the row functions take (callers check the dtype first).
#define GSPO_DISPATCH_F32_BF16(TYPE, NAME, ...)                              \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))
