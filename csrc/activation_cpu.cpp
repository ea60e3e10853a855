// SwiGLU on a CPU, forward and backward, for float32 and bfloat16: h = [a, b] along the last dimension (2F),
// y = silu(a) * b, computed in float32 and rounded once per output.
//
// Megatron's MLP computes it as chunk, silu, multiply: three tensors forward, and backward two multiplies, silu's
// backward and a cat of the two halves, each a pass over [T, F] or [T, 2F] (2.2-3.2 ms a SmolLM2 layer in bf16
// with 2 threads). Here the forward is one pass and the backward writes both halves of dh in one pass. The pure-torch
// twin is gspo_mcore.ops.reference.swiglu_forward / swiglu_backward; tests/ops/test_ops_activation.py compares.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "checks.h"
#include "ops.h"
#include "rowops.h"

namespace gspo {
namespace {

constexpr int64_t kGrain = 8;  // rows per task

void check_input(const at::Tensor& h, const char* name) {
  GSPO_CHECK(h.device().is_cpu(), name, " must be a CPU tensor, got ", h.device());
  GSPO_CHECK(h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16, name,
             " must be float32 or bfloat16, got ", h.scalar_type());
  GSPO_CHECK(h.dim() >= 1 && h.size(-1) % 2 == 0, name, "'s last dimension must be even (the two halves), got shape ",
             h.sizes());
}

}  // namespace

at::Tensor swiglu_forward_cpu(const at::Tensor& h) {
  check_input(h, "swiglu: h");
  const auto hc = h.contiguous();
  const int64_t F = h.size(-1) / 2, R = F ? h.numel() / (2 * F) : 0;
  auto sizes = h.sizes().vec();
  sizes.back() = F;
  auto y = at::empty(sizes, h.options());
  GSPO_DISPATCH_F32_BF16(h.scalar_type(), "swiglu_forward", [&] {
    const scalar_t* hp = hc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, R, kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) GSPO_ROWOP(swiglu_forward_row, hp + r * 2 * F, yp + r * F, F);
    });
  });
  return y;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad, const at::Tensor& h) {
  check_input(h, "swiglu_backward: h");
  const int64_t F = h.size(-1) / 2, R = F ? h.numel() / (2 * F) : 0;
  GSPO_CHECK(grad.scalar_type() == h.scalar_type(), "swiglu_backward: grad is ", grad.scalar_type(), " but h is ",
             h.scalar_type());
  GSPO_CHECK(grad.dim() == h.dim() && grad.size(-1) == F && grad.numel() == R * F, "swiglu_backward: grad has shape ",
             grad.sizes(), " but h of shape ", h.sizes(), " gives outputs of last dimension ", F);
  const auto gc = grad.contiguous(), hc = h.contiguous();
  auto dh = at::empty_like(hc);
  GSPO_DISPATCH_F32_BF16(h.scalar_type(), "swiglu_backward", [&] {
    const scalar_t *gp = gc.data_ptr<scalar_t>(), *hp = hc.data_ptr<scalar_t>();
    scalar_t* dhp = dh.data_ptr<scalar_t>();
    at::parallel_for(0, R, kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) GSPO_ROWOP(swiglu_backward_row, gp + r * F, hp + r * 2 * F, dhp + r * 2 * F, F);
    });
  });
  return dh;
}

}  // namespace gspo
