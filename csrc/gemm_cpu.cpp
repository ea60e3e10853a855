// A matrix product whose rows are split across torch's CPU threads, each thread one single-threaded GEMM.
//
// oneDNN, which runs torch's bfloat16 matmuls on a CPU, does not always use every thread: measured on a 2-core
// Xeon (AMX), [1002, 1536] x [1536, 576] ran at about 1150 GFLOP/s on one thread and on two, the same product
// with 512 rows at about 2100 on two. Half of a small model's GEMMs have such a narrow output (the attention's
// output projection, the MLP's down projection, and the input gradients of every projection back to the hidden
// size). Here the rows are cut into one block per thread, each computed by at::mm_out inside the parallel region
// (where oneDNN runs on the calling thread alone): 2000-2300 GFLOP/s for those shapes on the same machine.
// Each output row is the same dot products as in one GEMM; only the GEMM's blocking may differ.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "checks.h"
#include "ops.h"

namespace gspo {

at::Tensor mm_rows_cpu(const at::Tensor& a, const at::Tensor& b, int64_t min_rows) {
  GSPO_CHECK(a.device().is_cpu() && b.device().is_cpu(), "mm_rows: a and b must be CPU tensors, got ", a.device(),
             " and ", b.device());
  GSPO_CHECK_DIM(a, 2, "mm_rows: a");
  GSPO_CHECK_DIM(b, 2, "mm_rows: b");
  GSPO_CHECK(a.size(1) == b.size(0), "mm_rows: a is ", a.sizes(), " and b is ", b.sizes(),
             ": a's columns must equal b's rows");
  GSPO_CHECK(a.scalar_type() == b.scalar_type(), "mm_rows: a (", a.scalar_type(), ") and b (", b.scalar_type(),
             ") must have one dtype");
  GSPO_CHECK(min_rows >= 1, "mm_rows: min_rows must be >= 1, got ", min_rows);
  const int64_t M = a.size(0);
  const int64_t blocks = std::min<int64_t>(at::get_num_threads(), M / min_rows);
  if (blocks < 2 || at::in_parallel_region()) return at::mm(a, b);
  at::Tensor out = at::empty({M, b.size(1)}, a.options());
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    // grad mode is per thread: a worker thread would dispatch the inputs' autograd (a parameter requires grad)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r0 = M * i / blocks, r1 = M * (i + 1) / blocks;
      at::Tensor rows = out.narrow(0, r0, r1 - r0);
      at::mm_out(rows, a.narrow(0, r0, r1 - r0), b);
    }
  });
  return out;
}

}  // namespace gspo
