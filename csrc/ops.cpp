// Op schemas (TORCH_LIBRARY), argument validation and the pybind11 module of gspo_mcore._C.
// Autograd formulas and fake (meta) kernels are registered from Python (gspo_mcore/ops/_backend.py).
#include "ops.h"

#include <torch/extension.h>

#include "checks.h"

namespace gspo {

void check_stats_args(const at::Tensor& logits, const at::Tensor& targets) {
  GSPO_CHECK_DIM(logits, 2, "logits");
  GSPO_CHECK_DIM(targets, 1, "targets");
  auto dt = logits.scalar_type();
  GSPO_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
             "logits must be float32, bfloat16 or float16, got ", dt);
  GSPO_CHECK_DTYPE(targets, at::kLong, "targets");
  GSPO_CHECK(logits.size(0) == targets.size(0), "logits has ", logits.size(0), " rows but targets has ",
             targets.size(0), " entries (expected logits [T, V_local] and targets [T])");
  GSPO_CHECK(logits.size(1) > 0, "logits must have at least one vocabulary column");
  GSPO_CHECK(logits.stride(1) == 1, "logits must be contiguous along the vocabulary dimension");
  GSPO_CHECK_SAME_DEVICE(logits, targets, "logits", "targets");
}

void check_backward_args(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                         const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                         const std::optional<at::Tensor>& grad_entropy) {
  check_stats_args(logits, targets);
  const int64_t T = logits.size(0);
  for (auto* p : {&lse, &grad_logp}) {
    const char* name = p == &lse ? "lse" : "grad_logp";
    GSPO_CHECK(p->dim() == 1 && p->size(0) == T, name, " must have shape [", T, "], got ", p->sizes());
    GSPO_CHECK_DTYPE(*p, at::kFloat, name);
    GSPO_CHECK_SAME_DEVICE(*p, logits, name, "logits");
  }
  GSPO_CHECK(entropy.has_value() == grad_entropy.has_value(),
             "entropy and grad_entropy must be given together");
  if (entropy.has_value()) {
    for (auto* p : {&*entropy, &*grad_entropy}) {
      const char* name = p == &*entropy ? "entropy" : "grad_entropy";
      GSPO_CHECK(p->dim() == 1 && p->size(0) == T, name, " must have shape [", T, "], got ", p->sizes());
      GSPO_CHECK_DTYPE(*p, at::kFloat, name);
      GSPO_CHECK_SAME_DEVICE(*p, logits, name, "logits");
    }
  }
}

void check_inplace_args(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                        const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                        const std::optional<at::Tensor>& grad_entropy) {
  check_backward_args(logits, targets, lse, grad_logp, entropy, grad_entropy);
  GSPO_CHECK_CONTIG(logits, "logits (overwritten in place)");
}

void check_segment_args(const at::Tensor& values, const at::Tensor& mask, const at::Tensor& cu_seqlens) {
  GSPO_CHECK_DIM(values, 1, "values");
  GSPO_CHECK_DIM(mask, 1, "mask");
  GSPO_CHECK_DIM(cu_seqlens, 1, "cu_seqlens");
  GSPO_CHECK_DTYPE(values, at::kFloat, "values");
  GSPO_CHECK_DTYPE(mask, at::kFloat, "mask");
  GSPO_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
             "cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  GSPO_CHECK(cu_seqlens.size(0) >= 1, "cu_seqlens must have B+1 >= 1 entries");
  GSPO_CHECK(values.size(0) == mask.size(0), "values has ", values.size(0), " tokens but mask has ",
             mask.size(0));
  GSPO_CHECK_SAME_DEVICE(values, mask, "values", "mask");
  GSPO_CHECK_SAME_DEVICE(values, cu_seqlens, "values", "cu_seqlens");
}

void check_sequence_args(const at::Tensor& seq_sum, const at::Tensor& seq_count, const at::Tensor& adv) {
  for (auto* p : {&seq_sum, &seq_count, &adv}) {
    const char* name = p == &seq_sum ? "seq_logratio_sum" : (p == &seq_count ? "seq_token_count" : "advantages");
    GSPO_CHECK_DIM(*p, 1, name);
    GSPO_CHECK_DTYPE(*p, at::kFloat, name);
    GSPO_CHECK(p->size(0) == seq_sum.size(0), name, " has ", p->size(0), " entries but seq_logratio_sum has ",
               seq_sum.size(0));
    GSPO_CHECK_SAME_DEVICE(*p, seq_sum, name, "seq_logratio_sum");
  }
}

}  // namespace gspo

TORCH_LIBRARY(gspo_mcore, m) {
  // Per-token partial statistics of logits[:, :] * inv_temperature over this rank's vocabulary slice
  // [vocab_start, vocab_start + V_local): float32 [T, 5] (max, sum-exp, x-sum, target value, owned).
  m.def("token_logprob_stats(Tensor logits, Tensor targets, int vocab_start, float inv_temperature, "
        "bool with_entropy) -> Tensor");
  // d logits of (sum_t grad_logp[t] * logp[t] + grad_entropy[t] * entropy[t]) given the global lse.
  m.def("token_logprob_backward(Tensor logits, Tensor targets, Tensor lse, Tensor grad_logp, "
        "Tensor? entropy, Tensor? grad_entropy, int vocab_start, float inv_temperature) -> Tensor");
  // token_logprob_backward written over the logits themselves (the in-place backward: no [T, V] allocation).
  m.def("token_logprob_grad_inplace_(Tensor(a!) logits, Tensor targets, Tensor lse, Tensor grad_logp, "
        "Tensor? entropy, Tensor? grad_entropy, int vocab_start, float inv_temperature) -> ()");
  // out[b] = sum_{t in segment b, mask[t] != 0} mask[t] * values[t]   (float32 [B]; masked values never count)
  m.def("segment_sum(Tensor values, Tensor mask, Tensor cu_seqlens) -> Tensor");
  // out[t] = mask[t] != 0 ? mask[t] * grad[segment(t)] : 0  (float32 [T]); the backward of segment_sum
  m.def("segment_expand(Tensor grad, Tensor mask, Tensor cu_seqlens) -> Tensor");
  // GSPO's sequence-level ratio and clipping: per-sequence loss term, ratio, clipped flag and
  // d term / d seq_logratio_sum.
  m.def("gspo_sequence_terms(Tensor seq_logratio_sum, Tensor seq_token_count, Tensor advantages, "
        "float eps_low, float eps_high) -> (Tensor, Tensor, Tensor, Tensor)");
  // RMSNorm over the last dimension: (y, rstd float32 [rows]); its backward gives (dx, dweight).
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  // SwiGLU over the last dimension's two halves h = [a, b]: silu(a) * b; its backward gives dh.
  m.def("swiglu_forward(Tensor h) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor h) -> Tensor");
  // In place over scores [G, R, S]: entries the mask [MB, SQ, S] marks (row i of matrix g reads mask row
  // (MB == 1 ? 0 : g / groups_per_batch, i % SQ)) set to fill, then softmax over S; and the softmax's backward
  // p * (grad - sum(grad * p)) written over grad.
  m.def("masked_softmax_(Tensor(a!) scores, Tensor? mask, int groups_per_batch, float fill) -> ()");
  m.def("softmax_backward_(Tensor(a!) grad, Tensor probs) -> ()");
  // a @ b with a's rows split across the CPU threads, one single-threaded GEMM each (at least min_rows rows).
  m.def("mm_rows(Tensor a, Tensor b, int min_rows) -> Tensor");
  // Rotary position embedding of x [S, B, H, D] (halves rotated) by angles with cos, sin [S, 1 or B, D / 2];
  // sign = -1 rotates back (the backward).
  m.def("rope(Tensor x, Tensor cos, Tensor sin, float sign) -> Tensor");
  // dst += src in float32 for a float32 dst and a float32 or bfloat16 src of the same shape, one pass.
  m.def("accumulate_(Tensor(a!) dst, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(gspo_mcore, CPU, m) {
  m.impl("token_logprob_stats", &gspo::token_logprob_stats_cpu);
  m.impl("token_logprob_backward", &gspo::token_logprob_backward_cpu);
  m.impl("token_logprob_grad_inplace_", &gspo::token_logprob_grad_inplace_cpu);
  m.impl("segment_sum", &gspo::segment_sum_cpu);
  m.impl("segment_expand", &gspo::segment_expand_cpu);
  m.impl("gspo_sequence_terms", &gspo::gspo_sequence_terms_cpu);
  m.impl("rms_norm_forward", &gspo::rms_norm_forward_cpu);
  m.impl("rms_norm_backward", &gspo::rms_norm_backward_cpu);
  m.impl("swiglu_forward", &gspo::swiglu_forward_cpu);
  m.impl("swiglu_backward", &gspo::swiglu_backward_cpu);
  m.impl("masked_softmax_", &gspo::masked_softmax_cpu_);
  m.impl("softmax_backward_", &gspo::softmax_backward_cpu_);
  m.impl("mm_rows", &gspo::mm_rows_cpu);
  m.impl("rope", &gspo::rope_cpu);
  m.impl("accumulate_", &gspo::accumulate_cpu_);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "gspo_mcore compiled kernels; the ops live under torch.ops.gspo_mcore";
#ifdef GSPO_WITH_CUDA
  mod.attr("built_with_cuda") = true;
#else
  mod.attr("built_with_cuda") = false;
#endif
  mod.def("cpu_isa", &gspo::cpu_isa, "The instruction set the CPU vocabulary kernels use");
  mod.def("set_cpu_isa", &gspo::set_cpu_isa, "Force the CPU kernels' instruction set ('auto' = best)");
  mod.def("supported_cpu_isas", &gspo::supported_cpu_isas);
  mod.def("set_grad_buffer_cache", &gspo::set_grad_buffer_cache,
          "Keep the last freed CPU gradient buffer for reuse (default on); off frees it");
  mod.def("set_flush_denormal_all_threads", &gspo::set_flush_denormal_all_threads,
          "Flush-to-zero and denormals-are-zero on this thread and all of torch's CPU threads; the thread count");
  mod.def("grad_buffer_cache_bytes", &gspo::grad_buffer_cache_bytes, "Bytes held by the CPU gradient buffer cache");
}
