// A gradient accumulated into a float32 buffer in one pass: dst += src for float32 dst and bfloat16 or float32 src.
//
// Megatron-Core's data-parallel wrapper adds each parameter's gradient into its float32 main_grad with
// `main_grad.add_(grad)`. For a bfloat16 gradient on a CPU, torch first makes a float32 copy of the whole gradient and
// then adds it (two passes, and a temporary the size of the parameter): measured on SmolLM2-135M in bf16 on 2 threads,
// about 70 ms of a 1.4-1.5 s learner step went to those copies. Here each element is read once, widened, added and
// stored. The twin is `dst.add_(src)` (gspo_mcore.ops.reference.accumulate_); tests/ops/test_ops_accumulate.py compares.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "checks.h"
#include "ops.h"
#include "rowops.h"

namespace gspo {

void accumulate_cpu_(at::Tensor& dst, const at::Tensor& src) {
  GSPO_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "accumulate_: dst and src must be CPU tensors, got ",
             dst.device(), " and ", src.device());
  GSPO_CHECK_DTYPE(dst, at::kFloat, "accumulate_: dst");
  GSPO_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16,
             "accumulate_: src must be float32 or bfloat16, got ", src.scalar_type());
  GSPO_CHECK(dst.sizes() == src.sizes(), "accumulate_: dst ", dst.sizes(), " and src ", src.sizes(),
             " must have the same shape");
  GSPO_CHECK(dst.is_contiguous(), "accumulate_: dst must be contiguous (it is written in place)");
  const auto sc = src.contiguous();
  float* dp = dst.data_ptr<float>();
  const int64_t n = dst.numel();
  constexpr int64_t kBlock = 1 << 14;  // elements per task: 64 KiB of float32, whole cache lines
  GSPO_DISPATCH_F32_BF16(src.scalar_type(), "accumulate_", [&] {
    const scalar_t* sp = sc.data_ptr<scalar_t>();
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
      const int64_t i0 = b0 * kBlock, i1 = std::min(n, b1 * kBlock);
      GSPO_ROWOP(add_row, dp + i0, sp + i0, i1 - i0);
    });
  });
}

}  // namespace gspo
