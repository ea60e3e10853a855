// Plain C++ entry points of the CUDA kernels (csrc/cuda/*.cu), called from register_cuda.cpp.
//
// No torch headers here on purpose: the .cu files include only this header and the CUDA runtime, which
// keeps nvcc fast. Every launcher takes raw device pointers, sizes and the stream to launch on; it does
// not synchronise and does not check errors (the caller runs C10_CUDA_KERNEL_LAUNCH_CHECK). Launchers
// return without launching when there is nothing to do (T == 0 or B == 0).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace gspo {
namespace cuda {

enum class LogitsDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// out: float32 [T, 5] contiguous (max, sumexp, xsum, target value, owned), see csrc/checks.h.
// logits: [T, V] with row stride `ld` elements and unit column stride; targets: int64 [T] contiguous.
void launch_token_logprob_stats(const void* logits, LogitsDtype dtype, int64_t T, int64_t V, int64_t ld,
                                const int64_t* targets, int64_t vocab_start, float inv_temperature,
                                bool with_entropy, float* out, cudaStream_t stream);

// grad_out: [T, V] contiguous, in the logits' dtype; it may be the logits themselves when they are contiguous
// (ld == V): every element is read before it is written, by the same thread. lse, grad_logp: float32 [T] contiguous.
// entropy and grad_entropy: float32 [T] contiguous, both null or both non-null.
void launch_token_logprob_backward(const void* logits, LogitsDtype dtype, int64_t T, int64_t V, int64_t ld,
                                   const int64_t* targets, const float* lse, const float* grad_logp,
                                   const float* entropy, const float* grad_entropy, int64_t vocab_start,
                                   float inv_temperature, void* grad_out, cudaStream_t stream);

// out[b] = sum_{t in [cu[b], cu[b+1]), mask[t] != 0} mask[t] * values[t]   (double accumulation,
// deterministic). cu_seqlens: B+1 entries, int64 if cu_is_int64 else int32. out: float32 [B].
void launch_segment_sum(const float* values, const float* mask, const void* cu_seqlens, bool cu_is_int64,
                        int64_t B, int64_t T, float* out, cudaStream_t stream);

// out[t] = mask[t] * grad[segment(t)] (0 where mask[t] == 0 or t is in no segment). out: float32 [T].
void launch_segment_expand(const float* grad, const float* mask, const void* cu_seqlens, bool cu_is_int64,
                           int64_t B, int64_t T, float* out, cudaStream_t stream);

// Elementwise over B sequences; see gspo_sequence_terms_cpu in csrc/segments_cpu.cpp.
void launch_gspo_sequence_terms(const float* seq_sum, const float* seq_count, const float* adv, int64_t B,
                                float eps_low, float eps_high, float* term, float* ratio, float* clipped,
                                float* coef, cudaStream_t stream);

}  // namespace cuda
}  // namespace gspo
