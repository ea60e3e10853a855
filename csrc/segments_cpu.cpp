// CPU kernels for the per-sequence part of the loss over packed (THD) segments: masked segment sums,
// their backward, and GSPO's sequence-level ratio and clipping. All O(T) or O(B).
#include <ATen/Parallel.h>

#include <cmath>

#include "checks.h"
#include "ops.h"

namespace gspo {
namespace {

template <typename I>
void check_offsets_cpu(const I* cu, int64_t B, int64_t T) {
  GSPO_CHECK(cu[0] == 0, "cu_seqlens must start at 0, got ", static_cast<int64_t>(cu[0]));
  for (int64_t b = 0; b < B; ++b)
    GSPO_CHECK(cu[b] <= cu[b + 1], "cu_seqlens must be non-decreasing, but cu_seqlens[", b,
               "]=", static_cast<int64_t>(cu[b]), " > cu_seqlens[", b + 1, "]=", static_cast<int64_t>(cu[b + 1]));
  GSPO_CHECK(cu[B] == T, "cu_seqlens must end at the number of tokens T=", T, ", got ",
             static_cast<int64_t>(cu[B]));
}

template <typename F>
void dispatch_index(const at::Tensor& cu, F&& f) {
  if (cu.scalar_type() == at::kInt)
    f(cu.data_ptr<int32_t>());
  else
    f(cu.data_ptr<int64_t>());
}

}  // namespace

at::Tensor segment_sum_cpu(const at::Tensor& values, const at::Tensor& mask, const at::Tensor& cu_seqlens) {
  check_segment_args(values, mask, cu_seqlens);
  const int64_t B = cu_seqlens.size(0) - 1, T = values.size(0);
  auto v = values.contiguous(), mk = mask.contiguous(), cu = cu_seqlens.contiguous();
  auto out = at::empty({B}, values.options());
  const float *vp = v.data_ptr<float>(), *mp = mk.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch_index(cu, [&](auto* c) {
    check_offsets_cpu(c, B, T);
    at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        double s = 0.0;  // double accumulation: exact enough that the order of tokens does not matter
        for (int64_t t = c[b]; t < c[b + 1]; ++t)
          if (mp[t] != 0.0f) s += static_cast<double>(mp[t]) * vp[t];  // masked-out values never count, even NaN
        op[b] = static_cast<float>(s);
      }
    });
  });
  return out;
}

at::Tensor segment_expand_cpu(const at::Tensor& grad, const at::Tensor& mask, const at::Tensor& cu_seqlens) {
  GSPO_CHECK_DIM(grad, 1, "grad");
  GSPO_CHECK_DTYPE(grad, at::kFloat, "grad");
  check_segment_args(mask, mask, cu_seqlens);
  const int64_t B = cu_seqlens.size(0) - 1, T = mask.size(0);
  GSPO_CHECK(grad.size(0) == B, "grad has ", grad.size(0), " entries but cu_seqlens describes ", B, " sequences");
  GSPO_CHECK_SAME_DEVICE(grad, mask, "grad", "mask");
  auto g = grad.contiguous(), mk = mask.contiguous(), cu = cu_seqlens.contiguous();
  auto out = at::empty({T}, mask.options());
  const float *gp = g.data_ptr<float>(), *mp = mk.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch_index(cu, [&](auto* c) {
    check_offsets_cpu(c, B, T);
    at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t t = c[b]; t < c[b + 1]; ++t) op[t] = mp[t] != 0.0f ? mp[t] * gp[b] : 0.0f;
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gspo_sequence_terms_cpu(
    const at::Tensor& seq_sum, const at::Tensor& seq_count, const at::Tensor& adv, double eps_low,
    double eps_high) {
  check_sequence_args(seq_sum, seq_count, adv);
  const int64_t B = seq_sum.size(0);
  auto s = seq_sum.contiguous(), n = seq_count.contiguous(), a = adv.contiguous();
  auto term = at::empty({B}, s.options()), ratio = at::empty({B}, s.options());
  auto clipped = at::empty({B}, s.options()), coef = at::empty({B}, s.options());
  const float *sp = s.data_ptr<float>(), *np = n.data_ptr<float>(), *ap = a.data_ptr<float>();
  float *tp = term.data_ptr<float>(), *rp = ratio.data_ptr<float>(), *cp = clipped.data_ptr<float>(),
        *kp = coef.data_ptr<float>();
  const float lo = 1.0f - static_cast<float>(eps_low), hi = 1.0f + static_cast<float>(eps_high);
  for (int64_t b = 0; b < B; ++b) {
    const float cnt = np[b], A = ap[b];
    if (!(cnt > 0.0f)) {  // a sequence with no counted token contributes nothing
      tp[b] = 0.0f, rp[b] = 1.0f, cp[b] = 0.0f, kp[b] = 0.0f;
      continue;
    }
    const float r = std::exp(sp[b] / cnt);
    const float rc = r < lo ? lo : (r > hi ? hi : r);
    const bool clip = (A > 0.0f && r > hi) || (A < 0.0f && r < lo);
    // loss term = -min(r * A, clip(r) * A); d term / d seq_sum = -[not clipped] * A * r / cnt
    const float ra = r * A;
    tp[b] = -std::fmin(ra, rc * A);
    if (ra != ra) tp[b] = NAN;  // fmin would hide a NaN (r or A NaN, or r = inf with A = 0)
    rp[b] = r;
    cp[b] = clip ? 1.0f : 0.0f;
    kp[b] = clip ? 0.0f : -A * r / cnt;
  }
  return {term, ratio, clipped, coef};
}

}  // namespace gspo
