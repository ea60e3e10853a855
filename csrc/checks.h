// Readable argument checks shared by the CPU and CUDA op implementations.
#pragma once
#include <torch/types.h>

#define GSPO_CHECK(cond, ...) TORCH_CHECK(cond, "gspo_mcore: ", __VA_ARGS__)
#define GSPO_CHECK_DIM(t, d, name) \
  GSPO_CHECK((t).dim() == (d), name, " must be ", d, "-D, got shape ", (t).sizes())
#define GSPO_CHECK_DTYPE(t, dt, name) \
  GSPO_CHECK((t).scalar_type() == (dt), name, " must be ", dt, ", got ", (t).scalar_type())
#define GSPO_CHECK_CONTIG(t, name) GSPO_CHECK((t).is_contiguous(), name, " must be contiguous")
#define GSPO_CHECK_SAME_DEVICE(a, b, na, nb) \
  GSPO_CHECK((a).device() == (b).device(), na, " is on ", (a).device(), " but ", nb, " is on ", (b).device())

namespace gspo {

// Columns of the per-token statistics written by token_logprob_stats (one row per token).
enum Stat : int64_t {
  kMax = 0,     // max over this rank's vocabulary slice of logits * inv_temperature
  kSumExp = 1,  // sum_v exp(z_v - max)
  kXSum = 2,    // sum_v exp(z_v - max) * (z_v - max)   (entropy only; 0 otherwise)
  kTarget = 3,  // z at the target id if this rank owns it, else 0
  kOwned = 4,   // 1 if this rank owns the target id, else 0
  kNumStats = 5,
};

}  // namespace gspo
