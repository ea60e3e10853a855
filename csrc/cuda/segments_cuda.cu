// CUDA kernels for the per-sequence part of the loss over packed (THD) segments: masked segment sums,
// their backward, and GSPO's sequence-level ratio and clipping. The CPU twins are in
// csrc/segments_cpu.cpp (the pure-torch specification in gspo_mcore/ops/reference.py).
//
// cu_seqlens is device memory here and is NOT validated (that would need a device-to-host sync); the
// Python layer validates it. Every read is guarded so that a malformed cu_seqlens gives wrong numbers,
// never an out-of-bounds access.
//
// Only CUDA headers are included (see csrc/cuda/launchers.h).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "launchers.h"

namespace gspo {
namespace cuda {
namespace {

constexpr int kSumThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxGrid = 1 << 30;

inline unsigned grid_of(int64_t blocks) {
  return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
}

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// One block per sequence (grid-stride over sequences). Each thread accumulates its strided share of
// the tokens in double, then a fixed shuffle/shared-memory tree combines them: the result does not
// depend on timing (no atomics), and with double accumulation of exact float*float products it
// rounds to the same float as the CPU kernel's sequential double sum in all but pathological cases.
// A token with mask == 0 is skipped, so a NaN/inf value under a zero mask does not count (the
// documented contract of gspo_mcore.ops.segment_sum and reference.segment_sum).
template <typename I>
__global__ void __launch_bounds__(kSumThreads)
    segment_sum_kernel(const float* __restrict__ values, const float* __restrict__ mask, const I* __restrict__ cu,
                       int64_t B, int64_t T, float* __restrict__ out) {
  __shared__ double sh[kSumThreads / kWarp];
  const int warp = threadIdx.x / kWarp, wl = threadIdx.x % kWarp;
  for (int64_t b = blockIdx.x; b < B; b += gridDim.x) {  // uniform over the block
    const int64_t t0 = clamp64(static_cast<int64_t>(cu[b]), 0, T);
    const int64_t t1 = clamp64(static_cast<int64_t>(cu[b + 1]), t0, T);
    double acc = 0.0;
    for (int64_t t = t0 + threadIdx.x; t < t1; t += kSumThreads) {
      const float mk = mask[t];
      if (mk != 0.0f) acc += static_cast<double>(mk) * static_cast<double>(values[t]);
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) acc += __shfl_down_sync(0xFFFFFFFFu, acc, off);
    if (wl == 0) sh[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      acc = wl < kSumThreads / kWarp ? sh[wl] : 0.0;
#pragma unroll
      for (int off = kWarp / 2; off > 0; off >>= 1) acc += __shfl_down_sync(0xFFFFFFFFu, acc, off);
      if (wl == 0) out[b] = static_cast<float>(acc);
    }
    __syncthreads();  // sh is rewritten for the next sequence
  }
}

// One thread per token: its segment is the last b in [0, B] with cu[b] <= t (binary search over the
// B+1 offsets, so empty segments are skipped). Each output is written exactly once; a token that no
// segment covers (possible only for a malformed cu_seqlens) gets 0.
template <typename I>
__global__ void segment_expand_kernel(const float* __restrict__ grad, const float* __restrict__ mask,
                                      const I* __restrict__ cu, int64_t B, int64_t T, float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < T; t += stride) {
    int64_t lo = 0, hi = B + 1;  // first index in [0, B+1) with cu[index] > t
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<int64_t>(cu[mid]) <= t)
        lo = mid + 1;
      else
        hi = mid;
    }
    const int64_t b = lo - 1;
    float r = 0.0f;
    if (b >= 0 && b < B && static_cast<int64_t>(cu[b]) <= t && t < static_cast<int64_t>(cu[b + 1])) {
      const float mk = mask[t];
      if (mk != 0.0f) r = mk * grad[b];  // a zero mask never lets a NaN gradient through
    }
    out[t] = r;
  }
}

// Elementwise; the same expressions, in the same order, as gspo_sequence_terms_cpu.
__global__ void sequence_terms_kernel(const float* __restrict__ sp, const float* __restrict__ np,
                                      const float* __restrict__ ap, int64_t B, float lo, float hi,
                                      float* __restrict__ tp, float* __restrict__ rp, float* __restrict__ cp,
                                      float* __restrict__ kp) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < B; b += stride) {
    const float cnt = np[b], A = ap[b];
    if (!(cnt > 0.0f)) {  // a sequence with no counted token (or a NaN count) contributes nothing
      tp[b] = 0.0f;
      rp[b] = 1.0f;
      cp[b] = 0.0f;
      kp[b] = 0.0f;
      continue;
    }
    const float r = expf(sp[b] / cnt);
    const float rc = r < lo ? lo : (r > hi ? hi : r);
    const bool clip = (A > 0.0f && r > hi) || (A < 0.0f && r < lo);
    const float ra = r * A;
    float term = -fminf(ra, rc * A);
    if (ra != ra) term = NAN;  // fminf would hide a NaN (r or A NaN, or r = inf with A = 0)
    tp[b] = term;
    rp[b] = r;
    cp[b] = clip ? 1.0f : 0.0f;
    kp[b] = clip ? 0.0f : -A * r / cnt;
  }
}

}  // namespace

void launch_segment_sum(const float* values, const float* mask, const void* cu_seqlens, bool cu_is_int64,
                        int64_t B, int64_t T, float* out, cudaStream_t stream) {
  if (B <= 0) return;
  const unsigned grid = grid_of(B);
  if (cu_is_int64)
    segment_sum_kernel<int64_t><<<grid, kSumThreads, 0, stream>>>(
        values, mask, static_cast<const int64_t*>(cu_seqlens), B, T, out);
  else
    segment_sum_kernel<int32_t><<<grid, kSumThreads, 0, stream>>>(
        values, mask, static_cast<const int32_t*>(cu_seqlens), B, T, out);
}

void launch_segment_expand(const float* grad, const float* mask, const void* cu_seqlens, bool cu_is_int64,
                           int64_t B, int64_t T, float* out, cudaStream_t stream) {
  if (T <= 0) return;
  constexpr int kThreads = 256;
  const unsigned grid = grid_of((T + kThreads - 1) / kThreads);
  if (cu_is_int64)
    segment_expand_kernel<int64_t><<<grid, kThreads, 0, stream>>>(
        grad, mask, static_cast<const int64_t*>(cu_seqlens), B, T, out);
  else
    segment_expand_kernel<int32_t><<<grid, kThreads, 0, stream>>>(
        grad, mask, static_cast<const int32_t*>(cu_seqlens), B, T, out);
}

void launch_gspo_sequence_terms(const float* seq_sum, const float* seq_count, const float* adv, int64_t B,
                                float eps_low, float eps_high, float* term, float* ratio, float* clipped,
                                float* coef, cudaStream_t stream) {
  if (B <= 0) return;
  constexpr int kThreads = 256;
  const float lo = 1.0f - eps_low, hi = 1.0f + eps_high;
  sequence_terms_kernel<<<grid_of((B + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      seq_sum, seq_count, adv, B, lo, hi, term, ratio, clipped, coef);
}

}  // namespace cuda
}  // namespace gspo
