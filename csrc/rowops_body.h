// The row functions of the compiled element-wise kernels (rmsnorm_cpu.cpp, activation_cpu.cpp, softmax_cpu.cpp),
// written once as plain loops and compiled by rowops.h for each instruction set through GSPO_TARGET (a function
// attribute, so that torch's and c10's inline header functions keep the baseline target and the linker can never
// pick a wider copy of them). Not a standalone header: no include guard; rowops.h includes it once per ISA inside
// its own namespace, with ld() defined there. Reductions are `#pragma omp simd reduction`: the extension is
// compiled with -fopenmp, which lets the compiler reorder a sum or a max into vector lanes (plain C++ must not).

// One row: rstd and y. Returns rstd.
template <typename T>
GSPO_TARGET float rms_forward_row(const T* x, const T* w, T* y, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < H; ++j) ss += ld(x[j]) * ld(x[j]);
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) st(&y[j], ld(x[j]) * rstd * ld(w[j]));
  return rstd;
}

// One row of the backward: dx, and dw accumulated into the task's float32 partial sums.
//   xhat = x * rstd, g = dy * w, dx = rstd * (g - xhat * mean(g * xhat)), dw += dy * xhat.
template <typename T>
GSPO_TARGET void rms_backward_row(const T* dy, const T* x, const T* w, float rstd, T* dx, float* dw, int64_t H) {
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < H; ++j) {
    const float xhat = ld(x[j]) * rstd;
    dot += ld(dy[j]) * ld(w[j]) * xhat;
    dw[j] += ld(dy[j]) * xhat;
  }
  const float c = dot / static_cast<float>(H);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float xhat = ld(x[j]) * rstd;
    st(&dx[j], rstd * (ld(dy[j]) * ld(w[j]) - xhat * c));
  }
}

// SwiGLU: y = silu(a) * b for h = [a, b] (F each).
template <typename T>
GSPO_TARGET void swiglu_forward_row(const T* h, T* y, int64_t F) {
#pragma omp simd
  for (int64_t j = 0; j < F; ++j) {
    const float a = ld(h[j]), b = ld(h[F + j]);
    st(&y[j], a * vecmath::sigmoid(a) * b);
  }
}

// d/da (silu(a) b) = b s (1 + a (1 - s)) with s = sigmoid(a); d/db = silu(a).
template <typename T>
GSPO_TARGET void swiglu_backward_row(const T* dy, const T* h, T* dh, int64_t F) {
#pragma omp simd
  for (int64_t j = 0; j < F; ++j) {
    const float a = ld(h[j]), b = ld(h[F + j]), g = ld(dy[j]);
    const float s = vecmath::sigmoid(a);
    st(&dh[j], g * b * s * (1.0f + a * (1.0f - s)));
    st(&dh[F + j], g * a * s);
  }
}

// One row of n scores: masked entries (mask[j] != 0) set to fill, then softmax; e is float32 scratch of n.
template <typename T>
GSPO_TARGET void softmax_row(T* x, const bool* mask, float fill, float* e, int64_t n) {
  float m = -__builtin_inff();
  if (mask == nullptr) {
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) {
      e[j] = ld(x[j]);
      m = e[j] > m ? e[j] : m;
    }
  } else {  // a select on the mask's bytes, not a branch: random masks would defeat the branch predictor
    const unsigned char* mb = reinterpret_cast<const unsigned char*>(mask);
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) {
      const float v = ld(x[j]);
      e[j] = mb[j] != 0 ? fill : v;
      m = e[j] > m ? e[j] : m;
    }
  }
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    e[j] = vecmath::exp_approx(e[j] - m);
    s += e[j];
  }
  const float inv = 1.0f / s;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) st(&x[j], e[j] * inv);
}

// The softmax's backward over one row, written over g: g = p * (g - sum(g * p)).
template <typename T>
GSPO_TARGET void softmax_backward_row(T* g, const T* p, int64_t n) {
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < n; ++j) dot += ld(g[j]) * ld(p[j]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) st(&g[j], ld(p[j]) * (ld(g[j]) - dot));
}

// dst += src over n elements, in float32.
template <typename T>
GSPO_TARGET void add_row(float* dst, const T* src, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] += ld(src[j]);
}

// Rotary position embedding over one row [x1, x2] (half each): y1 = x1 cos - sign x2 sin, y2 = x2 cos + sign x1 sin,
// with one angle per pair (c, s: half each). sign = -1 is the backward (the rotation's transpose).
template <typename T>
GSPO_TARGET void rope_row(const T* x, T* y, const float* c, const float* s, float sign, int64_t half) {
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float a = ld(x[j]), b = ld(x[half + j]), sj = sign * s[j];
    st(&y[j], a * c[j] - b * sj);
    st(&y[half + j], b * c[j] + a * sj);
  }
}
