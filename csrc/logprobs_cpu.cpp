// CPU kernels for per-token log-probs over a (possibly vocabulary-parallel) logits slice.
//
// Forward: two passes over each row (max; then sum of exp), the second from cache. It writes five
// float32 statistics per token and never materialises a [T, V] float32 tensor.
// Backward: one pass per row writes d logits directly in the logits' dtype.
//
// The row loops are written once (templates) and compiled for AVX-512, AVX2 and baseline x86-64 via
// target attributes; the best supported variant is chosen once at load time (overridable for tests).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "checks.h"
#include "ops.h"

namespace gspo {
namespace {

#define GSPO_INLINE inline __attribute__((always_inline))

// ---- scalar conversions that the auto-vectoriser understands ----
GSPO_INLINE float to_float(float x) { return x; }
GSPO_INLINE float to_float(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
GSPO_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }

GSPO_INLINE void from_float(float v, float* out) { *out = v; }
GSPO_INLINE void from_float(float v, c10::BFloat16* out) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  // round to nearest even; NaN stays a quiet NaN
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  out->x = static_cast<uint16_t>(v != v ? 0x7FC0u : r);
}
GSPO_INLINE void from_float(float v, c10::Half* out) { *out = c10::Half(v); }

// exp(x) for x <= ~0 (the kernels only call it on z - max or z - lse), accurate to ~1 ulp
// (Cody-Waite range reduction + Cephes' degree-6 polynomial). Branch free so that it vectorises.
// NaN propagates; x < -87.3 gives 0.
GSPO_INLINE float fast_exp(float x) {
  float xc = x > 88.0f ? 88.0f : x;
  xc = xc < -87.3f ? -87.3f : xc;
  const float t = xc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.0f : y * scale;
}

constexpr int64_t kChunk = 2048;  // float lane accumulators are flushed into double every chunk

template <typename T, bool kEntropy>
GSPO_INLINE void row_stats(const T* __restrict__ x, int64_t V, float it, float* out) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) {
    const float z = to_float(x[v]) * it;
    m = z > m ? z : m;
  }
  double s = 0.0, w = 0.0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk < V ? c0 + kChunk : V;
    float sc = 0.0f, wc = 0.0f;
    if constexpr (kEntropy) {
#pragma omp simd reduction(+ : sc, wc)
      for (int64_t v = c0; v < c1; ++v) {
        const float d = to_float(x[v]) * it - m;
        const float e = fast_exp(d);
        sc += e;
        wc += e * d;
      }
    } else {
#pragma omp simd reduction(+ : sc)
      for (int64_t v = c0; v < c1; ++v) sc += fast_exp(to_float(x[v]) * it - m);
    }
    s += sc;
    w += wc;
  }
  out[kMax] = m;
  out[kSumExp] = static_cast<float>(s);
  out[kXSum] = static_cast<float>(w);
}

// d logits for one row: it * (g * (onehot - p) - gh * p * (log p + H)), p = exp(z - lse).
template <typename T, bool kEntropy>
GSPO_INLINE void row_backward(const T* __restrict__ x, T* __restrict__ dx, int64_t V, float it, float lse,
                              float g, float h, float gh) {
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) {
    const float lp = to_float(x[v]) * it - lse;
    const float p = fast_exp(lp);
    float d = -p * g;
    if constexpr (kEntropy) d -= gh * p * (lp + h);
    from_float(d * it, dx + v);
  }
}

template <typename T>
struct RowFns {
  void (*stats)(const T*, int64_t, float, float*);
  void (*stats_entropy)(const T*, int64_t, float, float*);
  void (*backward)(const T*, T*, int64_t, float, float, float, float, float);
  void (*backward_entropy)(const T*, T*, int64_t, float, float, float, float, float);
};

#define GSPO_DEFINE_ISA(NAME, TARGET)                                                                    \
  template <typename T>                                                                                 \
  TARGET void NAME##_stats(const T* x, int64_t V, float it, float* o) { row_stats<T, false>(x, V, it, o); } \
  template <typename T>                                                                                 \
  TARGET void NAME##_stats_ent(const T* x, int64_t V, float it, float* o) {                             \
    row_stats<T, true>(x, V, it, o);                                                                    \
  }                                                                                                     \
  template <typename T>                                                                                 \
  TARGET void NAME##_bwd(const T* x, T* dx, int64_t V, float it, float l, float g, float h, float gh) {  \
    row_backward<T, false>(x, dx, V, it, l, g, h, gh);                                                  \
  }                                                                                                     \
  template <typename T>                                                                                 \
  TARGET void NAME##_bwd_ent(const T* x, T* dx, int64_t V, float it, float l, float g, float h, float gh) { \
    row_backward<T, true>(x, dx, V, it, l, g, h, gh);                                                   \
  }                                                                                                     \
  template <typename T>                                                                                 \
  RowFns<T> NAME##_fns() {                                                                              \
    return {&NAME##_stats<T>, &NAME##_stats_ent<T>, &NAME##_bwd<T>, &NAME##_bwd_ent<T>};                \
  }

#if defined(__x86_64__) && defined(__GNUC__)
GSPO_DEFINE_ISA(isa_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512"))))
GSPO_DEFINE_ISA(isa_avx2, __attribute__((target("avx2,fma,f16c"))))
#define GSPO_HAVE_X86_ISAS 1
#endif
GSPO_DEFINE_ISA(isa_default, )

enum class Isa { kDefault, kAvx2, kAvx512 };

bool isa_supported(Isa isa) {
#ifdef GSPO_HAVE_X86_ISAS
  switch (isa) {
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
  return isa == Isa::kAvx512 ? "avx512" : (isa == Isa::kAvx2 ? "avx2" : "default");
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
    if (isa_supported(isa)) return isa;
  return Isa::kDefault;
}

Isa g_isa = best_isa();

template <typename T>
RowFns<T> row_fns() {
#ifdef GSPO_HAVE_X86_ISAS
  if (g_isa == Isa::kAvx512) return isa_avx512_fns<T>();
  if (g_isa == Isa::kAvx2) return isa_avx2_fns<T>();
#endif
  return isa_default_fns<T>();
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

}  // namespace

std::string cpu_isa() { return isa_name(g_isa); }

std::vector<std::string> supported_cpu_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kDefault})
    if (isa_supported(isa)) out.emplace_back(isa_name(isa));
  return out;
}

std::string set_cpu_isa(const std::string& name) {
  if (name == "auto") {
    g_isa = best_isa();
    return cpu_isa();
  }
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kDefault}) {
    if (name == isa_name(isa)) {
      GSPO_CHECK(isa_supported(isa), "this CPU does not support the '", name, "' kernels");
      g_isa = isa;
      return cpu_isa();
    }
  }
  GSPO_CHECK(false, "unknown CPU ISA '", name, "' (expected auto, avx512, avx2 or default)");
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
    const RowFns<T_> fns = row_fns<T_>();
    auto stats = with_entropy ? fns.stats_entropy : fns.stats;
    at::parallel_for(0, T, grain_for(V), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T_* row = xp + t * ld;
        float* o = op + t * kNumStats;
        stats(row, V, it, o);
        const int64_t local = tp[t] - vocab_start;
        const bool owned = local >= 0 && local < V;
        o[kTarget] = owned ? to_float(row[local]) * it : 0.0f;
        o[kOwned] = owned ? 1.0f : 0.0f;
      }
    });
  });
  return out;
}

at::Tensor token_logprob_backward_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                      const at::Tensor& grad_logp, const std::optional<at::Tensor>& entropy,
                                      const std::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                                      double inv_temperature) {
  check_backward_args(logits, targets, lse, grad_logp, entropy, grad_entropy);
  const int64_t T = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto grad = at::empty({T, V}, logits.options());
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
    T_* dp = grad.data_ptr<T_>();
    const RowFns<T_> fns = row_fns<T_>();
    auto bwd = ent ? fns.backward_entropy : fns.backward;
    at::parallel_for(0, T, grain_for(V), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T_* row = xp + t * ld;
        T_* drow = dp + t * V;
        const float g = gp[t];
        bwd(row, drow, V, it, lp[t], g, ent ? hp[t] : 0.0f, ent ? ghp[t] : 0.0f);
        const int64_t local = tp[t] - vocab_start;
        if (local >= 0 && local < V) {
          // add the one-hot term to the already written value, in float
          const float lpv = to_float(row[local]) * it - lp[t];
          const float p = std::exp(lpv);
          float d = g * (1.0f - p);
          if (ent) d -= ghp[t] * p * (lpv + hp[t]);
          from_float(d * it, drow + local);
        }
      }
    });
  });
  return grad;
}

}  // namespace gspo
