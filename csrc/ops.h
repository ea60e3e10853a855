// Declarations shared by the op registration (ops.cpp), the CPU kernels and the CUDA registration.
#pragma once
#include <torch/types.h>

#include <optional>
#include <string>
#include <tuple>

namespace gspo {

// ---- argument validation (device independent; never reads tensor data) ----
void check_stats_args(const at::Tensor& logits, const at::Tensor& targets);
void check_backward_args(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                         const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                         const std::optional<at::Tensor>& grad_entropy);
void check_inplace_args(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                        const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                        const std::optional<at::Tensor>& grad_entropy);
void check_segment_args(const at::Tensor& values, const at::Tensor& mask, const at::Tensor& cu_seqlens);
void check_sequence_args(const at::Tensor& seq_sum, const at::Tensor& seq_count, const at::Tensor& adv);

// ---- CPU implementations ----
at::Tensor token_logprob_stats_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                   double inv_temperature, bool with_entropy);
at::Tensor token_logprob_backward_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                      const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                      const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                      double inv_temperature);
void token_logprob_grad_inplace_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                    const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                    const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                    double inv_temperature);
at::Tensor segment_sum_cpu(const at::Tensor& values, const at::Tensor& mask, const at::Tensor& cu_seqlens);
at::Tensor segment_expand_cpu(const at::Tensor& grad, const at::Tensor& mask, const at::Tensor& cu_seqlens);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gspo_sequence_terms_cpu(
    const at::Tensor& seq_sum, const at::Tensor& seq_count, const at::Tensor& adv, double eps_low,
    double eps_high);

// ---- RMSNorm (rmsnorm_cpu.cpp): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) per row of the last dim ----
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd);

// ---- SwiGLU (activation_cpu.cpp): h = [a, b] on the last dim, y = silu(a) * b ----
at::Tensor swiglu_forward_cpu(const at::Tensor& h);
at::Tensor swiglu_backward_cpu(const at::Tensor& grad, const at::Tensor& h);

// ---- the attention's softmax (softmax_cpu.cpp), in place ----
void masked_softmax_cpu_(at::Tensor& scores, const std::optional<at::Tensor>& mask, int64_t groups_per_batch,
                         double fill);
void softmax_backward_cpu_(at::Tensor& grad, const at::Tensor& probs);

// ---- a GEMM with its rows split across the CPU threads (gemm_cpu.cpp) ----
at::Tensor mm_rows_cpu(const at::Tensor& a, const at::Tensor& b, int64_t min_rows);

// ---- a gradient accumulated into a float32 buffer (accumulate_cpu.cpp) ----
void accumulate_cpu_(at::Tensor& dst, const at::Tensor& src);

// ---- rotary position embedding (rope_cpu.cpp) ----
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign);

// ---- CPU instruction-set selection for the vocabulary kernels ----
std::string cpu_isa();                      // the ISA in use: "avx512_bf16", "avx512", "avx2" or "default"
std::string set_cpu_isa(const std::string&);  // force one ("auto" = best supported); returns the ISA in use
std::vector<std::string> supported_cpu_isas();

// ---- the CPU gradient buffer cache (logprobs_cpu.cpp) ----
void set_grad_buffer_cache(bool enabled);
int64_t grad_buffer_cache_bytes();

// Flush-to-zero and denormals-are-zero on the calling thread and every thread of torch's CPU pool (torch's own
// set_flush_denormal sets the calling thread only). Returns how many threads now have them (0: not supported).
int64_t set_flush_denormal_all_threads(bool on);

}  // namespace gspo
