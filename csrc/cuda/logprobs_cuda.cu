// CUDA kernels for per-token log-probs over a (possibly vocabulary-parallel) logits slice.
// The CPU twins in csrc/logprobs_cpu.cpp are the specification; this file reproduces their outputs
// (same columns, NaN/inf behaviour, ownership rule) up to float rounding.
//
// Layout: a "group" of threads owns one row of logits: a warp (kGroup = 32, 8 rows per block) for
// short rows, or the whole 256-thread block for long rows. Each row is split into
//   head:  the elements before the first 16-byte boundary (at most 7; scalar loads),
//   body:  16-byte vectors (4 float or 8 bf16/fp16 elements), two per thread per step, with the
//          next step's two vectors already in flight while the current ones are processed,
//   tail:  the elements after the last whole vector (scalar loads).
// An odd row stride or a view into a wider tensor therefore only moves elements between head, body
// and tail; no vector load is ever misaligned.
//
// Forward (token_logprob_stats): a single streaming pass. Each thread keeps an online state
// (m, s, w) = (running max, sum exp(z - m), sum exp(z - m) (z - m)), rebased when its max grows; the
// group merges the states with a fixed shuffle tree (deterministic).
// Backward (token_logprob_backward): one pass per row writes d logits in the logits' dtype.
//
// Only CUDA headers are included: torch's headers make nvcc very slow (see csrc/cuda/launchers.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "launchers.h"

namespace gspo {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // threads per block for both kernels
constexpr int kWarp = 32;
constexpr int kMinBlocks = 4;  // resident blocks per SM to aim for (caps registers at 64 per thread)
constexpr int kNumStats = 5;   // columns, in the order of csrc/checks.h (enum Stat)
constexpr int64_t kWarpRowMaxV = 2048;  // rows up to this many elements: one warp per row

// ---------------------------------------------------------------------------------------------------
// Element types. Storage is the raw type in memory; values are always handled as float.
struct F32 {};
struct BF16 {};
struct F16 {};

template <typename Tag>
struct Elem;

template <>
struct Elem<F32> {
  using Storage = float;
  static constexpr int kVec = 4;  // elements per 16-byte vector
  static __device__ __forceinline__ float load(const float* p) { return __ldg(p); }
  static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
  static __device__ __forceinline__ uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

// bfloat16 -> float is exact (the 16 bits are the high half of the float); float -> bfloat16 rounds
// to nearest even (cvt.rn.bf16x2.f32), like from_float in the CPU kernels.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162_raw r = __floats2bfloat162_rn(lo, hi);  // lo -> .x (lower address)
  return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

template <>
struct Elem<BF16> {
  using Storage = uint16_t;
  static constexpr int kVec = 8;
  static __device__ __forceinline__ float load(const uint16_t* p) {
    return __uint_as_float(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(p))) << 16);
  }
  static __device__ __forceinline__ void store(uint16_t* p, float v) {
    *p = static_cast<uint16_t>(pack_bf16x2(v, 0.0f) & 0xFFFFu);
  }
  static __device__ __forceinline__ void unpack2(uint32_t w, float* f) {
    f[0] = __uint_as_float(w << 16);           // element at the lower address
    f[1] = __uint_as_float(w & 0xFFFF0000u);   // element at the higher address
  }
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    unpack2(u.x, f);
    unpack2(u.y, f + 2);
    unpack2(u.z, f + 4);
    unpack2(u.w, f + 6);
  }
  static __device__ __forceinline__ uint4 pack(const float* f) {
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
  }
};

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2_raw r = __floats2half2_rn(lo, hi);  // lo -> .x (lower address)
  return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

template <>
struct Elem<F16> {
  using Storage = uint16_t;
  static constexpr int kVec = 8;
  static __device__ __forceinline__ float load(const uint16_t* p) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
  }
  static __device__ __forceinline__ void store(uint16_t* p, float v) {
    *p = __half_as_ushort(__float2half_rn(v));
  }
  static __device__ __forceinline__ void unpack2(uint32_t w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    unpack2(u.x, f);
    unpack2(u.y, f + 2);
    unpack2(u.z, f + 4);
    unpack2(u.w, f + 6);
  }
  static __device__ __forceinline__ uint4 pack(const float* f) {
    return make_uint4(pack_f16x2(f[0], f[1]), pack_f16x2(f[2], f[3]), pack_f16x2(f[4], f[5]),
                      pack_f16x2(f[6], f[7]));
  }
};

// Logits are read exactly once: stream them past the caches.
__device__ __forceinline__ uint4 load_vec(const uint4* p) { return __ldcs(p); }

// Number of leading elements of `p` before the first 16-byte boundary, or V (all scalar) when `p`
// is not even aligned to its element size. Clamped to V.
template <typename S>
__device__ __forceinline__ int64_t head_elements(const S* p, int64_t V) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const int64_t h = (a % sizeof(S)) != 0 ? V : static_cast<int64_t>(((16u - (a & 15u)) & 15u) / sizeof(S));
  return h < V ? h : V;
}

// Walks the body of a row: nvec 16-byte vectors starting at xv; thread `lane` of a group of kGroup
// threads takes vectors lane, lane + kGroup, ... Two vectors per step (pair(j0, a, j1, b)), with the
// next pair's loads issued before the current pair is processed; a leftover vector goes to one(j, a).
template <int kGroup, typename Pair, typename One>
__device__ __forceinline__ void walk_body(const uint4* __restrict__ xv, int64_t nvec, int lane, Pair&& pair,
                                          One&& one) {
  int64_t j = lane;
  uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
  if (j + kGroup < nvec) {
    a = load_vec(xv + j);
    b = load_vec(xv + j + kGroup);
  }
  while (j + kGroup < nvec) {
    const uint4 ca = a, cb = b;
    const int64_t jn = j + 2 * kGroup;
    if (jn + kGroup < nvec) {
      a = load_vec(xv + jn);
      b = load_vec(xv + jn + kGroup);
    }
    pair(j, ca, j + kGroup, cb);
    j = jn;
  }
  if (j < nvec) one(j, load_vec(xv + j));
}

// ---------------------------------------------------------------------------------------------------
// Forward: online (max, sum-exp, x-sum) state.
//
// Invariant: s = sum exp(z - ms), w = sum exp(z - ms) (z - ms) over the elements pushed so far, with
// ms = m if m > -inf else 0. While m == -inf every pushed z was -inf or NaN, so s and w are 0 or NaN
// (a -inf element adds exp(-inf) = 0 to s and to w, a NaN one NaN to both, exactly as the CPU kernel does).
// m never becomes NaN (fmaxf and `>` skip NaN); a NaN element makes s (and w) NaN through exp(NaN).
template <bool kEnt>
struct Online {
  float m = -INFINITY, s = 0.0f, w = 0.0f;

  // Re-express (s, w) relative to m_new >= m (m_new not NaN).
  __device__ __forceinline__ void rebase(float m_new) {
    if (m_new == m) return;  // also covers -inf == -inf and +inf == +inf
    const float dl = m - m_new;  // < 0; -inf when m == -inf or m_new == +inf
    const float c = expf(dl);
    // w' = sum e' (z - m_new) = c (w + dl s). When m == -inf, s is 0 or NaN and dl * s would be NaN
    // for s == 0, so only scale w (c = 0 then: a finite w goes to 0, a NaN w stays NaN).
    if (kEnt) w = c * (m == -INFINITY ? w : fmaf(dl, s, w));
    s *= c;
    m = m_new;
  }

  template <int K>
  __device__ __forceinline__ void push(const float* z) {
    float vm = z[0];
#pragma unroll
    for (int i = 1; i < K; ++i) vm = fmaxf(vm, z[i]);  // NaN only if all K are NaN
    if (vm > m) rebase(vm);
    const float ms = m == -INFINITY ? 0.0f : m;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const float d = z[i] - ms;
      const float e = expf(d);  // not __expf: keep the accuracy of the CPU path
      s += e;
      // e == 0 (d = -inf, or d below exp's range) adds 0 to w, as the CPU kernel's clamped exponent does:
      // fmaf(0, -inf, w) would make an all -inf row's w NaN where the CPU's is 0
      if (kEnt) w = fmaf(e, e == 0.0f ? 0.0f : d, w);
    }
  }

  __device__ __forceinline__ void merge(Online o) {
    const float M = fmaxf(m, o.m);
    rebase(M);
    o.rebase(M);
    s += o.s;
    if (kEnt) w += o.w;
  }
};

// Butterfly over the 32 lanes of a warp: every lane ends with the merge of all 32 states (the same
// value on every lane, since each merge is symmetric in its two operands).
template <bool kEnt>
__device__ __forceinline__ void warp_merge(Online<kEnt>& a) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    Online<kEnt> o;
    o.m = __shfl_xor_sync(0xFFFFFFFFu, a.m, off);
    o.s = __shfl_xor_sync(0xFFFFFFFFu, a.s, off);
    if (kEnt) o.w = __shfl_xor_sync(0xFFFFFFFFu, a.w, off);
    a.merge(o);
  }
}

template <typename Tag, bool kEnt, int kGroup>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    stats_kernel(const typename Elem<Tag>::Storage* __restrict__ logits, int64_t T, int64_t V, int64_t ld,
                 const int64_t* __restrict__ targets, int64_t vocab_start, float it, float* __restrict__ out) {
  using E = Elem<Tag>;
  using S = typename E::Storage;
  constexpr int N = E::kVec;
  constexpr int kRows = kThreads / kGroup;  // rows per block
  constexpr int kWarps = kThreads / kWarp;
  static_assert(kGroup == kWarp || kGroup == kThreads, "a row is owned by a warp or by the block");
  __shared__ float sh_m[kWarps], sh_s[kWarps], sh_w[kWarps];

  const int lane = threadIdx.x % kGroup;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kRows;
  // The loop condition is uniform over a group (and so over the block when kGroup == kThreads,
  // which the __syncthreads below need).
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kGroup; row < T; row += step) {
    const S* x = logits + row * ld;

    float tval = 0.0f, owned = 0.0f;
    if (lane == 0) {  // issue this scalar load early; the value is needed only at the end
      const int64_t local = targets[row] - vocab_start;
      if (local >= 0 && local < V) {
        tval = E::load(x + local) * it;
        owned = 1.0f;
      }
    }

    Online<kEnt> acc;
    const int64_t head = head_elements(x, V);
    const int64_t nvec = (V - head) / N;
    for (int64_t i = lane; i < head; i += kGroup) {
      const float z = E::load(x + i) * it;
      acc.template push<1>(&z);
    }
    walk_body<kGroup>(
        reinterpret_cast<const uint4*>(x + head), nvec, lane,
        [&](int64_t, const uint4& a, int64_t, const uint4& b) {
          float z[2 * N];
          E::unpack(a, z);
          E::unpack(b, z + N);
#pragma unroll
          for (int k = 0; k < 2 * N; ++k) z[k] *= it;
          acc.template push<2 * N>(z);
        },
        [&](int64_t, const uint4& a) {
          float z[N];
          E::unpack(a, z);
#pragma unroll
          for (int k = 0; k < N; ++k) z[k] *= it;
          acc.template push<N>(z);
        });
    for (int64_t i = head + nvec * N + lane; i < V; i += kGroup) {
      const float z = E::load(x + i) * it;
      acc.template push<1>(&z);
    }

    warp_merge(acc);
    if constexpr (kGroup > kWarp) {
      const int warp = threadIdx.x / kWarp, wl = threadIdx.x % kWarp;
      if (wl == 0) {
        sh_m[warp] = acc.m;
        sh_s[warp] = acc.s;
        sh_w[warp] = acc.w;
      }
      __syncthreads();
      if (warp == 0) {
        Online<kEnt> part;  // identity for lanes without a warp
        if (wl < kWarps) {
          part.m = sh_m[wl];
          part.s = sh_s[wl];
          part.w = sh_w[wl];
        }
        warp_merge(part);
        acc = part;
      }
      __syncthreads();  // sh_* is rewritten by the next row
    }

    if (lane == 0) {  // lane 0 of warp 0 when the block owns the row
      // All elements -inf: s = w = 0 (every exp is 0), as on the CPU, so that a vocabulary shard whose logits
      // are all masked adds nothing when the shards' statistics are merged; a NaN element makes them NaN.
      const float s = acc.s, w = kEnt ? acc.w : 0.0f;
      float* o = out + row * kNumStats;
      o[0] = acc.m;  // kMax
      o[1] = s;      // kSumExp
      o[2] = w;      // kXSum
      o[3] = tval;   // kTarget
      o[4] = owned;  // kOwned
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward: d logits = it * (g * (onehot - p) - gh * p * (log p + H)), p = exp(z - lse).

template <bool kEnt>
__device__ __forceinline__ float grad_plain(float z, float lse, float g, float h, float gh, float it) {
  const float lp = z - lse;
  const float p = expf(lp);
  float d = -p * g;
  if (kEnt) d -= gh * p * (lp + h);
  return d * it;
}

template <bool kEnt>
__device__ __forceinline__ float grad_target(float z, float lse, float g, float h, float gh, float it) {
  const float lp = z - lse;
  const float p = expf(lp);
  float d = g * (1.0f - p);
  if (kEnt) d -= gh * p * (lp + h);
  return d * it;
}

template <typename Tag, bool kEnt, int kGroup>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    backward_kernel(const typename Elem<Tag>::Storage* __restrict__ logits, int64_t T, int64_t V, int64_t ld,
                    const int64_t* __restrict__ targets, const float* __restrict__ lse,
                    const float* __restrict__ grad_logp, const float* __restrict__ entropy,
                    const float* __restrict__ grad_entropy, int64_t vocab_start, float it,
                    typename Elem<Tag>::Storage* __restrict__ out) {
  using E = Elem<Tag>;
  using S = typename E::Storage;
  constexpr int N = E::kVec;
  constexpr int kRows = kThreads / kGroup;
  static_assert(kGroup == kWarp || kGroup == kThreads, "a row is owned by a warp or by the block");

  const int lane = threadIdx.x % kGroup;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kRows;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kGroup; row < T; row += step) {
    const S* x = logits + row * ld;
    S* o = out + row * V;
    const float l = lse[row], g = grad_logp[row];
    const float h = kEnt ? entropy[row] : 0.0f, gh = kEnt ? grad_entropy[row] : 0.0f;
    int64_t local = targets[row] - vocab_start;
    if (!(local >= 0 && local < V)) local = -1;  // not owned: matches no column

    // Vector loads and stores share one element grouping only if input and output rows sit at the
    // same offset modulo 16 bytes (always so for contiguous logits); otherwise everything is scalar.
    const uintptr_t ax = reinterpret_cast<uintptr_t>(x), ao = reinterpret_cast<uintptr_t>(o);
    const int64_t head = (ax & 15u) == (ao & 15u) ? head_elements(x, V) : V;
    const int64_t nvec = (V - head) / N;

    auto scalar = [&](int64_t i) {
      const float z = E::load(x + i) * it;
      E::store(o + i, i == local ? grad_target<kEnt>(z, l, g, h, gh, it) : grad_plain<kEnt>(z, l, g, h, gh, it));
    };
    // d for one vector whose first element is column `base`; the target column, if it falls in this
    // vector, is recomputed with the one-hot term (a single compare per vector on the common path).
    auto vector = [&](int64_t base, const uint4& u) -> uint4 {
      float z[N], d[N];
      E::unpack(u, z);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        z[k] *= it;
        d[k] = grad_plain<kEnt>(z[k], l, g, h, gh, it);
      }
      if (static_cast<uint64_t>(local - base) < static_cast<uint64_t>(N)) {
#pragma unroll
        for (int k = 0; k < N; ++k)
          if (base + k == local) d[k] = grad_target<kEnt>(z[k], l, g, h, gh, it);
      }
      return E::pack(d);
    };

    for (int64_t i = lane; i < head; i += kGroup) scalar(i);
    uint4* ov = reinterpret_cast<uint4*>(o + head);  // 16-byte aligned whenever nvec > 0
    walk_body<kGroup>(
        reinterpret_cast<const uint4*>(x + head), nvec, lane,
        [&](int64_t j0, const uint4& a, int64_t j1, const uint4& b) {
          const uint4 da = vector(head + j0 * N, a);
          const uint4 db = vector(head + j1 * N, b);
          ov[j0] = da;
          ov[j1] = db;
        },
        [&](int64_t j, const uint4& a) { ov[j] = vector(head + j * N, a); });
    for (int64_t i = head + nvec * N + lane; i < V; i += kGroup) scalar(i);
  }
}

// ---------------------------------------------------------------------------------------------------
// Launch helpers.

inline unsigned grid_for(int64_t T, int rows_per_block) {
  const int64_t blocks = (T + rows_per_block - 1) / rows_per_block;
  constexpr int64_t kMaxGrid = 1 << 30;  // rows beyond this are covered by the grid-stride loop
  return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
}

template <typename Tag, bool kEnt>
void stats_launch(const void* logits, int64_t T, int64_t V, int64_t ld, const int64_t* targets, int64_t vocab_start,
                  float it, float* out, cudaStream_t stream) {
  using S = typename Elem<Tag>::Storage;
  const S* x = static_cast<const S*>(logits);
  if (V <= kWarpRowMaxV)
    stats_kernel<Tag, kEnt, kWarp><<<grid_for(T, kThreads / kWarp), kThreads, 0, stream>>>(
        x, T, V, ld, targets, vocab_start, it, out);
  else
    stats_kernel<Tag, kEnt, kThreads><<<grid_for(T, 1), kThreads, 0, stream>>>(x, T, V, ld, targets, vocab_start,
                                                                               it, out);
}

template <typename Tag, bool kEnt>
void backward_launch(const void* logits, int64_t T, int64_t V, int64_t ld, const int64_t* targets, const float* lse,
                     const float* grad_logp, const float* entropy, const float* grad_entropy, int64_t vocab_start,
                     float it, void* grad_out, cudaStream_t stream) {
  using S = typename Elem<Tag>::Storage;
  const S* x = static_cast<const S*>(logits);
  S* o = static_cast<S*>(grad_out);
  if (V <= kWarpRowMaxV)
    backward_kernel<Tag, kEnt, kWarp><<<grid_for(T, kThreads / kWarp), kThreads, 0, stream>>>(
        x, T, V, ld, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, it, o);
  else
    backward_kernel<Tag, kEnt, kThreads><<<grid_for(T, 1), kThreads, 0, stream>>>(
        x, T, V, ld, targets, lse, grad_logp, entropy, grad_entropy, vocab_start, it, o);
}

}  // namespace

void launch_token_logprob_stats(const void* logits, LogitsDtype dtype, int64_t T, int64_t V, int64_t ld,
                                const int64_t* targets, int64_t vocab_start, float inv_temperature,
                                bool with_entropy, float* out, cudaStream_t stream) {
  if (T <= 0 || V <= 0) return;
  switch (dtype) {
    case LogitsDtype::kFloat32:
      return with_entropy ? stats_launch<F32, true>(logits, T, V, ld, targets, vocab_start, inv_temperature, out, stream)
                          : stats_launch<F32, false>(logits, T, V, ld, targets, vocab_start, inv_temperature, out, stream);
    case LogitsDtype::kBFloat16:
      return with_entropy ? stats_launch<BF16, true>(logits, T, V, ld, targets, vocab_start, inv_temperature, out, stream)
                          : stats_launch<BF16, false>(logits, T, V, ld, targets, vocab_start, inv_temperature, out, stream);
    case LogitsDtype::kFloat16:
      return with_entropy ? stats_launch<F16, true>(logits, T, V, ld, targets, vocab_start, inv_temperature, out, stream)
                          : stats_launch<F16, false>(logits, T, V, ld, targets, vocab_start, inv_temperature, out, stream);
  }
}

void launch_token_logprob_backward(const void* logits, LogitsDtype dtype, int64_t T, int64_t V, int64_t ld,
                                   const int64_t* targets, const float* lse, const float* grad_logp,
                                   const float* entropy, const float* grad_entropy, int64_t vocab_start,
                                   float inv_temperature, void* grad_out, cudaStream_t stream) {
  if (T <= 0 || V <= 0) return;
  const bool ent = entropy != nullptr && grad_entropy != nullptr;
#define GSPO_BWD(TAG)                                                                                         \
  return ent ? backward_launch<TAG, true>(logits, T, V, ld, targets, lse, grad_logp, entropy, grad_entropy,  \
                                          vocab_start, inv_temperature, grad_out, stream)                    \
             : backward_launch<TAG, false>(logits, T, V, ld, targets, lse, grad_logp, nullptr, nullptr,      \
                                           vocab_start, inv_temperature, grad_out, stream)
  switch (dtype) {
    case LogitsDtype::kFloat32:
      GSPO_BWD(F32);
    case LogitsDtype::kBFloat16:
      GSPO_BWD(BF16);
    case LogitsDtype::kFloat16:
      GSPO_BWD(F16);
  }
#undef GSPO_BWD
}

}  // namespace cuda
}  // namespace gspo
