// CPU op implementations of the per-token log-prob kernels over a (possibly vocabulary-parallel) logits slice.
//
// Forward (token_logprob_stats): one streaming pass per row in L1-sized chunks with an online log-sum-exp;
// five float32 statistics per token, never a [T, V] float32 tensor.
// Backward (token_logprob_backward): one pass per row writes d logits in the logits' dtype.
// In-place (token_logprob_grad_inplace_): the same backward written over the logits themselves (called from
// the autograd backward, when the logits are no longer needed), so no [T, V] buffer is allocated.
//
// The row loops are explicit vector code (logprobs_isa_impl.h), compiled for AVX-512, AVX2 and baseline
// x86-64 in their own translation units (logprobs_isa_*.cpp); the best supported set is chosen once at load
// time (overridable for tests and benchmarks). Rows are split over torch's threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>

#include "checks.h"
#include "logprobs_isa.h"
#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define GSPO_HAVE_X86_ISAS 1  // the AVX-512 and AVX2 kernels are built (logprobs_isa_avx*.cpp)
#endif

namespace gspo {

double cpu::exp_double(double x) { return std::exp(x); }

namespace {

#define GSPO_INLINE inline __attribute__((always_inline))

GSPO_INLINE float to_float(float x) { return x; }
GSPO_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
GSPO_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }

// The storage type the ISA kernels take for each logits dtype (same bits).
template <typename T>
struct KernelType;
template <>
struct KernelType<float> {
  using type = float;
  static const cpu::RowKernelsFor<float>& of(const cpu::RowKernels& k) { return k.f32; }
};
template <>
struct KernelType<c10::BFloat16> {
  using type = cpu::Bf16;
  static const cpu::RowKernelsFor<cpu::Bf16>& of(const cpu::RowKernels& k) { return k.bf16; }
};
template <>
struct KernelType<c10::Half> {
  using type = cpu::F16;
  static const cpu::RowKernelsFor<cpu::F16>& of(const cpu::RowKernels& k) { return k.f16; }
};
static_assert(sizeof(c10::BFloat16) == sizeof(cpu::Bf16) && sizeof(c10::Half) == sizeof(cpu::F16));

template <typename T>
const typename KernelType<T>::type* kptr(const T* p) {
  return reinterpret_cast<const typename KernelType<T>::type*>(p);
}
template <typename T>
typename KernelType<T>::type* kptr(T* p) {
  return reinterpret_cast<typename KernelType<T>::type*>(p);
}

enum class Isa { kDefault, kAvx2, kAvx512, kAvx512Bf16 };

bool isa_supported(Isa isa) {
#ifdef GSPO_HAVE_X86_ISAS
  switch (isa) {
    case Isa::kAvx512Bf16:
      return isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512bf16");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default:
      return true;
  }
#else
  return isa == Isa::kDefault;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

// Every ISA, best first.
constexpr Isa kIsas[] = {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kDefault};

Isa best_isa() {
  for (Isa isa : kIsas)
    if (isa_supported(isa)) return isa;
  return Isa::kDefault;
}

Isa g_isa = best_isa();

const cpu::RowKernels& row_kernels() {
#ifdef GSPO_HAVE_X86_ISAS
  if (g_isa == Isa::kAvx512Bf16) return cpu::kRowKernelsAvx512Bf16;
  if (g_isa == Isa::kAvx512) return cpu::kRowKernelsAvx512;
  if (g_isa == Isa::kAvx2) return cpu::kRowKernelsAvx2;
#endif
  return cpu::kRowKernelsDefault;
}

template <typename F>
void dispatch_logits_dtype(at::ScalarType dt, F&& f) {
  switch (dt) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      GSPO_CHECK(false, "unsupported logits dtype ", dt);
  }
}

int64_t grain_for(int64_t V) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1)); }

// Large gradient buffers: 2 MB aligned and madvise'd into transparent huge pages (where the kernel allows
// it), and the most recently freed one is kept for the next call (like torch's CUDA caching allocator).
// First-touching a fresh [T, V] buffer costs a page fault per page, which on virtual machines costs several
// times a streaming read of the logits and more than the kernel itself (tools/bench_logprobs.py prints it as
// "fresh [T,V] alloc + one write"); the learner calls the backward once per micro-batch with similar
// shapes, so after the first call the gradient is written into memory that is already mapped. The cache
// holds at most one buffer (so at most one [T, V] gradient of memory stays resident between calls);
// set_grad_buffer_cache(false) frees it and turns it off. Small buffers use torch's allocator.
constexpr size_t kHuge = size_t{2} << 20;

struct GradBufferCache {
  std::mutex mu;
  void* ptr = nullptr;
  size_t bytes = 0;
  bool enabled = true;

  // A cached block of at least `want` bytes (and at most twice that, not to pin much more than is used),
  // with its size in *got, or null.
  void* take(size_t want, size_t* got) {
    std::lock_guard<std::mutex> lock(mu);
    if (ptr == nullptr) return nullptr;
    if (bytes >= want && bytes <= 2 * want) {
      void* p = ptr;
      *got = bytes;
      ptr = nullptr;
      bytes = 0;
      return p;
    }
    std::free(ptr);  // the wrong size: give the memory back before a new block is mapped
    ptr = nullptr;
    bytes = 0;
    return nullptr;
  }
  void give(void* p, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    if (!enabled) {
      std::free(p);
      return;
    }
    if (ptr != nullptr) std::free(ptr);  // keep the most recent
    ptr = p;
    bytes = n;
  }
  void set_enabled(bool on) {
    std::lock_guard<std::mutex> lock(mu);
    enabled = on;
    if (!on && ptr != nullptr) {
      std::free(ptr);
      ptr = nullptr;
      bytes = 0;
    }
  }
  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mu);
    return ptr == nullptr ? 0 : bytes;
  }
};

GradBufferCache& grad_cache() {
  static GradBufferCache* cache = new GradBufferCache();  // never destroyed: deleters may run at exit
  return *cache;
}

at::Tensor empty_grad_buffer(int64_t T, int64_t V, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(T) * static_cast<size_t>(V) * options.dtype().itemsize();
  if (bytes < 2 * kHuge) return at::empty({T, V}, options);
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  size_t held = rounded;
  void* p = grad_cache().take(rounded, &held);
  if (p == nullptr) {
    if (posix_memalign(&p, kHuge, rounded) != 0 || p == nullptr) return at::empty({T, V}, options);
#ifdef MADV_HUGEPAGE
    (void)madvise(p, rounded, MADV_HUGEPAGE);  // advice only: without THP the buffer is ordinary memory
#endif
  }
  return at::from_blob(p, {T, V}, [held](void* q) { grad_cache().give(q, held); }, options);
}

}  // namespace

void set_grad_buffer_cache(bool enabled) { grad_cache().set_enabled(enabled); }
int64_t grad_buffer_cache_bytes() { return static_cast<int64_t>(grad_cache().cached_bytes()); }

std::string cpu_isa() { return isa_name(g_isa); }

std::vector<std::string> supported_cpu_isas() {
  std::vector<std::string> out;
  for (Isa isa : kIsas)
    if (isa_supported(isa)) out.emplace_back(isa_name(isa));
  return out;
}

std::string set_cpu_isa(const std::string& name) {
  if (name == "auto") {
    g_isa = best_isa();
    return cpu_isa();
  }
  for (Isa isa : kIsas) {
    if (name == isa_name(isa)) {
      GSPO_CHECK(isa_supported(isa), "this CPU does not support the '", name, "' kernels");
      g_isa = isa;
      return cpu_isa();
    }
  }
  GSPO_CHECK(false, "unknown CPU ISA '", name, "' (expected auto, avx512_bf16, avx512, avx2 or default)");
  return {};
}

at::Tensor token_logprob_stats_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                   double inv_temperature, bool with_entropy) {
  check_stats_args(logits, targets);
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto out = at::empty({T, kNumStats}, logits.options().dtype(at::kFloat));
  auto tgt = targets.contiguous();
  const int64_t* tp = tgt.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float it = static_cast<float>(inv_temperature);
  dispatch_logits_dtype(logits.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = logits.data_ptr<T_>();
    const auto& k = KernelType<T_>::of(row_kernels());
    auto stats = with_entropy ? k.stats_entropy : k.stats;
    at::parallel_for(0, T, grain_for(V), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T_* row = xp + t * ld;
        float* o = op + t * kNumStats;
        stats(kptr(row), V, it, o);  // o[kMax], o[kSumExp], o[kXSum]
        const int64_t local = tp[t] - vocab_start;
        const bool owned = local >= 0 && local < V;
        o[kTarget] = owned ? to_float(row[local]) * it : 0.0f;
        o[kOwned] = owned ? 1.0f : 0.0f;
      }
    });
  });
  return out;
}

namespace {

// d logits of (g * logp + gh * H) into drow (which may be row itself), one-hot term included.
template <typename T_>
GSPO_INLINE void grad_row(const cpu::RowKernelsFor<typename KernelType<T_>::type>& k, bool ent, const T_* row,
                          T_* drow, int64_t V, int64_t local, float it, float lse, float g, float h, float gh) {
  const bool owned = local >= 0 && local < V;
  const float xt = owned ? to_float(row[local]) : 0.0f;  // read before the row is overwritten
  (ent ? k.grad_entropy : k.grad)(kptr(row), kptr(drow), V, it, lse, g, h, gh);
  if (owned) {  // the one-hot term, in float, over the value the vector loop wrote
    const float lpv = xt * it - lse;
    const float p = std::exp(lpv);
    float d = g * (1.0f - p);
    if (ent) d -= gh * p * (lpv + h);
    drow[local] = static_cast<T_>(d * it);
  }
}

// d logits into `out` ([T, V] contiguous; may be `logits` itself).
void write_grad(const at::Tensor& logits, const at::Tensor& out, const at::Tensor& targets, const at::Tensor& lse,
                const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start, double inv_temperature) {
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto tgt = targets.contiguous();
  auto lse_c = lse.contiguous(), g_c = grad_logp.contiguous();
  const bool ent = entropy.has_value();
  at::Tensor h_c = ent ? entropy->contiguous() : at::Tensor();
  at::Tensor gh_c = ent ? grad_entropy->contiguous() : at::Tensor();
  const int64_t* tp = tgt.data_ptr<int64_t>();
  const float *lp = lse_c.data_ptr<float>(), *gp = g_c.data_ptr<float>();
  const float* hp = ent ? h_c.data_ptr<float>() : nullptr;
  const float* ghp = ent ? gh_c.data_ptr<float>() : nullptr;
  const float it = static_cast<float>(inv_temperature);
  dispatch_logits_dtype(logits.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = logits.data_ptr<T_>();
    T_* dp = out.data_ptr<T_>();
    const auto& k = KernelType<T_>::of(row_kernels());
    at::parallel_for(0, T, grain_for(V), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        grad_row<T_>(k, ent, xp + t * ld, dp + t * V, V, tp[t] - vocab_start, it, lp[t], gp[t],
                     ent ? hp[t] : 0.0f, ent ? ghp[t] : 0.0f);
    });
  });
}

}  // namespace

at::Tensor token_logprob_backward_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                      const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                      const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                      double inv_temperature) {
  check_backward_args(logits, targets, lse, grad_logp, entropy, grad_entropy);
  auto grad = empty_grad_buffer(logits.size(0), logits.size(1), logits.options());
  write_grad(logits, grad, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, inv_temperature);
  return grad;
}

void token_logprob_grad_inplace_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                    const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                    const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                    double inv_temperature) {
  check_inplace_args(logits, targets, lse, grad_logp, entropy, grad_entropy);
  write_grad(logits, logits, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, inv_temperature);
}

}  // namespace gspo
