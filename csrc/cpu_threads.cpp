// Floating-point flags of torch's CPU worker threads.
//
// torch.set_flush_denormal sets flush-to-zero and denormals-are-zero (x86: MXCSR's FTZ and DAZ bits) on the
// calling thread only, while torch's CPU kernels run on its OpenMP worker threads too, each with its own
// MXCSR. Attention probabilities in bfloat16 underflow into the denormal range all the time (a score 90 below
// its row's max), and arithmetic on a denormal operand takes a microcode assist of about a hundred cycles:
// measured on a 2-core Xeon, torch's bfloat16 softmax over [6, 1503, 501] took 15 ms with the flags on one of
// its two threads and 2.9 ms with them on both (docs/results/shared-prompt.md).
#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include "ops.h"

namespace gspo {

int64_t set_flush_denormal_all_threads(bool on) {
  if (!at::globalContext().setFlushDenormal(on)) return 0;  // this CPU cannot: nothing was changed
  const int n = at::get_num_threads();
  int64_t done = 0;
  // One region with exactly torch's thread count: libgomp runs it on the same pooled threads as torch's
  // at::parallel_for. Threads the pool creates later are cloned from this (the calling) thread and inherit
  // its flags.
#pragma omp parallel num_threads(n) reduction(+ : done)
  { done += at::globalContext().setFlushDenormal(on) ? 1 : 0; }
  return done;
}

}  // namespace gspo
