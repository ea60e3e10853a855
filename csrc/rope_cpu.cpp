// Rotary position embedding (non-interleaved, Megatron-Core's and Hugging Face's rotate-half layout) in one pass.
//
// Megatron's unfused RoPE takes cos and sin of the angles at every call, then multiplies, rotates (chunk, negate,
// cat), multiplies, adds and concatenates again, each a pass over the queries or keys, rounding to the model's dtype
// between them: 1.8-2.3 ms a SmolLM2 layer forward and backward in bf16 on 2 threads. Here each row (one head of
// one token) is read once and written once, computed in float32 and rounded once; the backward is the same rotation
// with the sine negated.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "checks.h"
#include "ops.h"
#include "rowops.h"

namespace gspo {

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign) {
  GSPO_CHECK(x.device().is_cpu(), "rope: x must be a CPU tensor, got ", x.device());
  GSPO_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
             "rope: x must be float32 or bfloat16, got ", x.scalar_type());
  GSPO_CHECK_DIM(x, 4, "rope: x");
  GSPO_CHECK_DTYPE(cos, at::kFloat, "rope: cos");
  GSPO_CHECK_DTYPE(sin, at::kFloat, "rope: sin");
  GSPO_CHECK_DIM(cos, 3, "rope: cos");
  const int64_t S = x.size(0), B = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  GSPO_CHECK(D % 2 == 0, "rope: x's last dimension must be even (the two halves), got shape ", x.sizes());
  GSPO_CHECK(cos.sizes() == sin.sizes(), "rope: cos ", cos.sizes(), " and sin ", sin.sizes(), " must match");
  const int64_t BF = cos.size(1);
  GSPO_CHECK(cos.size(0) == S && (BF == 1 || BF == B) && cos.size(2) == half, "rope: cos and sin must be [", S,
             ", 1 or ", B, ", ", half, "] for x of shape ", x.sizes(), ", got ", cos.sizes());
  const auto xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  auto y = at::empty_like(xc);
  const float sg = static_cast<float>(sign);
  GSPO_DISPATCH_F32_BF16(x.scalar_type(), "rope", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
    at::parallel_for(0, S * B * H, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s = r / (B * H), b = (r / H) % B;
        const int64_t a = (s * BF + (BF == 1 ? 0 : b)) * half;
        GSPO_ROWOP(rope_row, xp + r * D, yp + r * D, cp + a, sp + a, sg, half);
      }
    });
  });
  return y;
}

}  // namespace gspo
