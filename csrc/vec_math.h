// Element-wise float math written as plain scalar code that GCC vectorises inside a loop compiled for a wider
// instruction set (`__attribute__((target_clones(...)))`): no library calls, no branches, only arithmetic,
// rounding and integer bit operations on each element. Shared by the compiled element-wise kernels
// (activation_cpu.cpp, softmax_cpu.cpp).
#pragma once
#include <stdint.h>

namespace gspo {
namespace vecmath {

inline __attribute__((always_inline)) float bits_float(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for float32: the argument clamped to [-86, 88.7] (above, float32 overflows), Cody-Waite reduction
// x = n ln2 + r, a degree-6 polynomial for exp(r) on [-ln2/2, ln2/2], and 2^n built in the exponent bits. At most
// 2 float32 ulps from float64 over the range (tests/ops/test_ops_activation.py checks it against float64); x below
// -86 gives exactly 0 (exp(-86) = 4e-38). The low end keeps every intermediate a normal float: a clamp at -87.3
// made p * 2^-126 denormal for every masked score, and each denormal costs the CPU a microcode assist unless
// flush-to-zero is on (measured: the masked softmax 14 ms instead of 2.5 ms).
inline __attribute__((always_inline)) float exp_approx(float x) {
  const float lo = -86.0f, hi = 88.7f;
  const bool under = x < lo;
  x = x < lo ? lo : (x > hi ? hi : x);
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  float r = n * -0.693359375f + x;
  r = n * 2.12194440e-4f + r;
  float p = 1.3843652559444308e-3f;
  p = p * r + 8.37415549904108e-3f;
  p = p * r + 4.166800156235695e-2f;
  p = p * r + 1.6666431725025177e-1f;
  p = p * r + 4.999999403953552e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n for n in [-124, 128]: at 128 (x near 88.7) split as 2^127 * 2 so the exponent field stays valid
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni > 127 ? 127 : ni;
  const float s1 = bits_float(static_cast<uint32_t>(n1 + 127) << 23);
  const float s2 = bits_float(static_cast<uint32_t>(ni - n1 + 127) << 23);
  const float y = p * s1 * s2;
  return under ? 0.0f : y;
}

// 1 / (1 + exp(-x)), and silu(x) = x * sigmoid(x).
inline __attribute__((always_inline)) float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

}  // namespace vecmath
}  // namespace gspo
