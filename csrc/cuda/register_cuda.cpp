// CUDA implementations of the gspo_mcore ops: argument checks (shared with the CPU ops), output
// allocation, device guard and stream, then the raw-pointer launchers of csrc/cuda/*.cu.
//
// Compiled by the host compiler (not nvcc). ATen/cuda/CUDAContext.h is deliberately not included: it
// pulls in cusparse.h, which not every toolkit install has; c10/cuda gives the stream and the guard.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "../ops.h"
#include "launchers.h"

namespace gspo {
namespace {

void check_cuda(const at::Tensor& t, const char* name) {
  GSPO_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

cuda::LogitsDtype logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return cuda::LogitsDtype::kFloat32;
    case at::kBFloat16:
      return cuda::LogitsDtype::kBFloat16;
    case at::kHalf:
      return cuda::LogitsDtype::kFloat16;
    default:
      GSPO_CHECK(false, "unsupported logits dtype ", logits.scalar_type());
  }
  return cuda::LogitsDtype::kFloat32;  // unreachable
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

at::Tensor token_logprob_stats_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                    double inv_temperature, bool with_entropy) {
  check_stats_args(logits, targets);
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto out = at::empty({T, kNumStats}, logits.options().dtype(at::kFloat));
  if (T == 0) return out;
  auto tgt = targets.contiguous();
  cuda::launch_token_logprob_stats(logits.const_data_ptr(), logits_dtype(logits), T, V, ld,
                                   tgt.const_data_ptr<int64_t>(), vocab_start, static_cast<float>(inv_temperature),
                                   with_entropy, out.mutable_data_ptr<float>(), current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor token_logprob_backward_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                       const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                       const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                       double inv_temperature) {
  check_backward_args(logits, targets, lse, grad_logp, entropy, grad_entropy);
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto grad = at::empty({T, V}, logits.options());  // always contiguous
  if (T == 0) return grad;
  auto tgt = targets.contiguous();
  auto lse_c = lse.contiguous(), g_c = grad_logp.contiguous();
  const bool ent = entropy.has_value();
  at::Tensor h_c = ent ? entropy->contiguous() : at::Tensor();
  at::Tensor gh_c = ent ? grad_entropy->contiguous() : at::Tensor();
  cuda::launch_token_logprob_backward(
      logits.const_data_ptr(), logits_dtype(logits), T, V, ld, tgt.const_data_ptr<int64_t>(),
      lse_c.const_data_ptr<float>(), g_c.const_data_ptr<float>(), ent ? h_c.const_data_ptr<float>() : nullptr,
      ent ? gh_c.const_data_ptr<float>() : nullptr, vocab_start, static_cast<float>(inv_temperature),
      grad.mutable_data_ptr(), current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

// The backward kernel is elementwise (each thread reads x[i] before it writes d[i], target column included),
// so with grad_out == logits (contiguous: ld == V) it overwrites the logits in place.
void token_logprob_grad_inplace_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                     const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                     const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                     double inv_temperature) {
  check_inplace_args(logits, targets, lse, grad_logp, entropy, grad_entropy);
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), V = logits.size(1);
  if (T == 0) return;
  auto tgt = targets.contiguous();
  auto lse_c = lse.contiguous(), g_c = grad_logp.contiguous();
  const bool ent = entropy.has_value();
  at::Tensor h_c = ent ? entropy->contiguous() : at::Tensor();
  at::Tensor gh_c = ent ? grad_entropy->contiguous() : at::Tensor();
  cuda::launch_token_logprob_backward(logits.const_data_ptr(), logits_dtype(logits), T, V, V,
                                      tgt.const_data_ptr<int64_t>(), lse_c.const_data_ptr<float>(),
                                      g_c.const_data_ptr<float>(), ent ? h_c.const_data_ptr<float>() : nullptr,
                                      ent ? gh_c.const_data_ptr<float>() : nullptr, vocab_start,
                                      static_cast<float>(inv_temperature), logits.mutable_data_ptr(),
                                      current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor segment_sum_cuda(const at::Tensor& values, const at::Tensor& mask, const at::Tensor& cu_seqlens) {
  check_segment_args(values, mask, cu_seqlens);
  check_cuda(values, "values");
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t B = cu_seqlens.size(0) - 1, T = values.size(0);
  auto out = at::empty({B}, values.options());
  if (B == 0) return out;
  auto v = values.contiguous(), mk = mask.contiguous(), cu = cu_seqlens.contiguous();
  cuda::launch_segment_sum(v.const_data_ptr<float>(), mk.const_data_ptr<float>(), cu.const_data_ptr(),
                           cu.scalar_type() == at::kLong, B, T, out.mutable_data_ptr<float>(), current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor segment_expand_cuda(const at::Tensor& grad, const at::Tensor& mask, const at::Tensor& cu_seqlens) {
  GSPO_CHECK_DIM(grad, 1, "grad");
  GSPO_CHECK_DTYPE(grad, at::kFloat, "grad");
  check_segment_args(mask, mask, cu_seqlens);
  const int64_t B = cu_seqlens.size(0) - 1, T = mask.size(0);
  GSPO_CHECK(grad.size(0) == B, "grad has ", grad.size(0), " entries but cu_seqlens describes ", B, " sequences");
  GSPO_CHECK_SAME_DEVICE(grad, mask, "grad", "mask");
  check_cuda(mask, "mask");
  const c10::cuda::CUDAGuard guard(mask.device());
  auto out = at::empty({T}, mask.options());
  if (T == 0) return out;
  auto g = grad.contiguous(), mk = mask.contiguous(), cu = cu_seqlens.contiguous();
  cuda::launch_segment_expand(g.const_data_ptr<float>(), mk.const_data_ptr<float>(), cu.const_data_ptr(),
                              cu.scalar_type() == at::kLong, B, T, out.mutable_data_ptr<float>(),
                              current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gspo_sequence_terms_cuda(
    const at::Tensor& seq_sum, const at::Tensor& seq_count, const at::Tensor& adv, double eps_low,
    double eps_high) {
  check_sequence_args(seq_sum, seq_count, adv);
  check_cuda(seq_sum, "seq_logratio_sum");
  const c10::cuda::CUDAGuard guard(seq_sum.device());
  const int64_t B = seq_sum.size(0);
  auto s = seq_sum.contiguous(), n = seq_count.contiguous(), a = adv.contiguous();
  auto term = at::empty({B}, s.options()), ratio = at::empty({B}, s.options());
  auto clipped = at::empty({B}, s.options()), coef = at::empty({B}, s.options());
  if (B == 0) return {term, ratio, clipped, coef};
  cuda::launch_gspo_sequence_terms(s.const_data_ptr<float>(), n.const_data_ptr<float>(), a.const_data_ptr<float>(),
                                   B, static_cast<float>(eps_low), static_cast<float>(eps_high),
                                   term.mutable_data_ptr<float>(), ratio.mutable_data_ptr<float>(),
                                   clipped.mutable_data_ptr<float>(), coef.mutable_data_ptr<float>(),
                                   current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {term, ratio, clipped, coef};
}

}  // namespace
}  // namespace gspo

TORCH_LIBRARY_IMPL(gspo_mcore, CUDA, m) {
  m.impl("token_logprob_stats", &gspo::token_logprob_stats_cuda);
  m.impl("token_logprob_backward", &gspo::token_logprob_backward_cuda);
  m.impl("token_logprob_grad_inplace_", &gspo::token_logprob_grad_inplace_cuda);
  m.impl("segment_sum", &gspo::segment_sum_cuda);
  m.impl("segment_expand", &gspo::segment_expand_cuda);
  m.impl("gspo_sequence_terms", &gspo::gspo_sequence_terms_cuda);
}
