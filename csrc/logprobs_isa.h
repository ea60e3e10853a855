// Interface between the CPU op implementations (logprobs_cpu.cpp) and the per-instruction-set row kernels
// (logprobs_isa_avx512.cpp, logprobs_isa_avx2.cpp, logprobs_isa_default.cpp).
//
// No torch or standard-library headers here on purpose: each ISA translation unit is compiled for its own
// instruction set (`#pragma GCC target`), and an inline function from a shared header compiled there could
// be merged by the linker with the baseline copy and then run on a CPU without that instruction set. The
// ISA files therefore include only this header, <stdint.h> and the intrinsics headers, and export nothing
// but one constant table of function pointers (no code runs before a supported table is chosen).
#pragma once
#include <stdint.h>

namespace gspo {
namespace cpu {

// Storage-compatible stand-ins for c10::BFloat16 / c10::Half (one uint16_t of bits each).
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// One row of logits x[0..n) (already offset to this rank's slice), z = x * it with it = 1 / temperature > 0.
//   stats: out[0] = max z, out[1] = sum exp(z - max), out[2] = sum exp(z - max) (z - max) (0 without entropy).
//          One streaming pass over the row in L1-sized chunks (chunk max, then the chunk's exp sum from L1),
//          with the running sums rescaled whenever the max grows (online log-sum-exp).
//   grad:  dx[v] = it * p_v * (-g - gh (log p_v + h)), log p_v = z_v - lse (gh = h = 0 without entropy), i.e.
//          d logits without the one-hot term, which the caller adds. dx may alias x (the in-place op).
template <typename T>
struct RowKernelsFor {
  void (*stats)(const T* x, int64_t n, float it, float* out);
  void (*stats_entropy)(const T* x, int64_t n, float it, float* out);
  void (*grad)(const T* x, T* dx, int64_t n, float it, float lse, float g, float h, float gh);
  void (*grad_entropy)(const T* x, T* dx, int64_t n, float it, float lse, float g, float h, float gh);
};

struct RowKernels {
  RowKernelsFor<float> f32;
  RowKernelsFor<Bf16> bf16;
  RowKernelsFor<F16> f16;
};

extern const RowKernels kRowKernelsAvx512;   // AVX-512 F/BW/VL/DQ + FMA + F16C, 16 floats per vector
extern const RowKernels kRowKernelsAvx512Bf16;  // the same + AVX512_BF16 (the bfloat16 gradient's rounding)
extern const RowKernels kRowKernelsAvx2;     // AVX2 + FMA + F16C, 8 floats per vector
extern const RowKernels kRowKernelsDefault;  // baseline x86-64 (SSE2), 4 floats per vector

// std::exp in double, defined in logprobs_cpu.cpp (the ISA files call no library code of their own).
double exp_double(double x);

}  // namespace cpu
}  // namespace gspo
