// RMSNorm on a CPU, forward and backward, for float32 and bfloat16 rows: y = x * rstd * w with
// rstd = 1 / sqrt(mean(x^2) + eps), everything computed in float32 and each output rounded once.
//
// torch.nn.RMSNorm's forward is one fused op on a CPU, but its backward is composed of about ten element-wise
// ops over [T, H] (bf16 -> fp32 copies, pow, mean, mul, sums), each a pass over memory: measured 2.9 ms
// against 0.4 ms for the forward on SmolLM2's [1002, 576] bf16 rows with 2 threads. Here each pass is one
// loop over a row that stays in L1. The pure-torch twin is gspo_mcore.ops.reference.rms_norm_forward /
// rms_norm_backward; tests/ops/test_ops_rms_norm.py compares the two.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "rowops.h"

namespace gspo {
namespace {

constexpr int64_t kGrain = 16;  // rows per task: a 576-wide bf16 row is about 1 us of work

void check_args(const at::Tensor& x, const at::Tensor& w) {
  GSPO_CHECK(x.device().is_cpu(), "rms_norm: x must be a CPU tensor, got ", x.device());
  GSPO_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
             "rms_norm: x must be float32 or bfloat16, got ", x.scalar_type());
  GSPO_CHECK(x.dim() >= 1, "rms_norm: x must have at least 1 dimension");
  GSPO_CHECK_DIM(w, 1, "rms_norm: weight");
  GSPO_CHECK(w.size(0) == x.size(-1), "rms_norm: weight has ", w.size(0), " entries but x's last dimension is ",
             x.size(-1));
  GSPO_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight is ", w.scalar_type(), " but x is ",
             x.scalar_type());
  GSPO_CHECK_SAME_DEVICE(x, w, "x", "weight");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_args(x, weight);
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  auto y = at::empty_like(xc);
  auto rstd = at::empty({R}, x.options().dtype(at::kFloat));
  float* rp = rstd.data_ptr<float>();
  GSPO_DISPATCH_F32_BF16(x.scalar_type(), "rms_norm_forward", [&] {
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, R, kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rp[r] = GSPO_ROWOP(rms_forward_row, xp + r * H, wp, yp + r * H, H, static_cast<float>(eps));
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd) {
  check_args(x, weight);
  GSPO_CHECK(grad.sizes() == x.sizes(), "rms_norm_backward: grad has shape ", grad.sizes(), " but x has ",
             x.sizes());
  GSPO_CHECK(grad.scalar_type() == x.scalar_type(), "rms_norm_backward: grad is ", grad.scalar_type(),
             " but x is ", x.scalar_type());
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  GSPO_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == R, "rms_norm_backward: rstd must be float32 with ",
             R, " entries, got ", rstd.scalar_type(), " with ", rstd.numel());
  const auto gc = grad.contiguous(), xc = x.contiguous(), wc = weight.contiguous(), rc = rstd.contiguous();
  auto dx = at::empty_like(xc);
  // dw: float32 partial sums, one row per task (tasks are fixed by R and the grain, not by the thread count, so
  // the sum's order and result do not depend on how many threads run), added up in task order.
  const int64_t tasks = (R + kGrain - 1) / kGrain;
  std::vector<float> partial(static_cast<size_t>(std::max<int64_t>(tasks, 1) * H), 0.f);
  const float* rp = rc.data_ptr<float>();
  GSPO_DISPATCH_F32_BF16(x.scalar_type(), "rms_norm_backward", [&] {
    const scalar_t *gp = gc.data_ptr<scalar_t>(), *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* dw = partial.data() + t * H;
        for (int64_t r = t * kGrain; r < std::min(R, (t + 1) * kGrain); ++r)
          GSPO_ROWOP(rms_backward_row, gp + r * H, xp + r * H, wp, rp[r], dxp + r * H, dw, H);
      }
    });
  });
  auto dw32 = at::zeros({H}, x.options().dtype(at::kFloat));
  float* dwp = dw32.data_ptr<float>();
  for (int64_t t = 0; t < tasks; ++t)
    for (int64_t j = 0; j < H; ++j) dwp[j] += partial[t * H + j];
  return {dx, dw32.to(weight.scalar_type())};
}

}  // namespace gspo
