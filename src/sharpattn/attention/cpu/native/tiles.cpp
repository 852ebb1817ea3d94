// Fused per-tile loops of sharpattn's tiled attention paths (sharpattn/attention/cpu/native.py).
//
// Each function takes one tile of scores as `rows` contiguous rows of `cols` floats (B·H·r rows
// of c keys; each row sees all of them or, in a causal tile, a prefix given by `ends`: tiles
// with any other mask stay in PyTorch) and per-row values as arrays of
// `rows` floats; it does in one or two sweeps over each row (in cache) what the pure-PyTorch
// tile functions do in one pass over the tile per operation. The maths is theirs, line for line:
// attention/cpu/fused.py (entropy_tile, _EntropyPass.backward), attention/cpu/adaptive_tiled.py,
// the element-wise and row-normalised maps' tile maths (normalizers/unnormalised.py, kernels.py),
// attention/cpu/sparse_tiled.py and attention/cpu/stick_tiled.py. Plain C++ on raw pointers, no PyTorch headers:
// built by g++ with -O3 -march=native -ffast-math on first use (the inputs are finite: the
// callers check that, and no infinity is used here); rows are shared among `threads` OpenMP
// threads (the OpenMP runtime that PyTorch has loaded).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Below every finite score the callers pass: "no key seen yet" for adaptive's running maximum.
constexpr float kUnseen = -3.0e38f;

inline float row_max(const float* x, int64_t n, float init) {
  float lane[16];
  for (int k = 0; k < 16; ++k) lane[k] = init;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) lane[k] = lane[k] > x[j + k] ? lane[k] : x[j + k];
  float r = init;
  for (int k = 0; k < 16; ++k) r = r > lane[k] ? r : lane[k];
  for (; j < n; ++j) r = r > x[j] ? r : x[j];
  return r;
}

// The largest −x_j of a row (−min x).
inline float row_max_neg(const float* x, int64_t n) {
  float lane[16];
  for (int k = 0; k < 16; ++k) lane[k] = -x[0];
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) lane[k] = lane[k] > -x[j + k] ? lane[k] : -x[j + k];
  float r = -x[0];
  for (int k = 0; k < 16; ++k) r = r > lane[k] ? r : lane[k];
  for (; j < n; ++j) r = r > -x[j] ? r : -x[j];
  return r;
}

inline float row_abs_max(const float* x, int64_t n) {
  float lane[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int k = 0; k < 16; ++k) {
      float a = std::fabs(x[j + k]);
      lane[k] = lane[k] > a ? lane[k] : a;
    }
  float r = 0.f;
  for (int k = 0; k < 16; ++k) r = r > lane[k] ? r : lane[k];
  for (; j < n; ++j) r = r > std::fabs(x[j]) ? r : std::fabs(x[j]);
  return r;
}

// The keys row r sees in its tile: every one, or the first ends[r mod tile_rows] (a causal tile:
// rows of B·H heads × tile_rows query rows, each seeing a prefix of the tile's keys).
inline int64_t visible(const int32_t* ends, int64_t tile_rows, int64_t r, int64_t cols) {
  return ends == nullptr ? cols : std::min<int64_t>(cols, ends[r % tile_rows]);
}

inline void zero(float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = 0.f;
}

// Row r of a score tile s (x), with the keys past the row's end zeroed; returns how many keys
// the row sees.
inline int64_t forward_row(float* s, int64_t r, int64_t cols, const int32_t* ends,
                           int64_t tile_rows, float*& x) {
  x = s + r * cols;
  const int64_t n = visible(ends, tile_rows, r, cols);
  zero(x + n, cols - n);
  return n;
}

// Row r of a backward's score tile s and of its dO·vᵀ tile dp (x and g), with the keys past the
// row's end zeroed in both; returns how many keys the row sees.
inline int64_t backward_row(float* s, float* dp, int64_t r, int64_t cols, const int32_t* ends,
                            int64_t tile_rows, float*& x, float*& g) {
  const int64_t n = forward_row(s, r, cols, ends, tile_rows, x);
  g = dp + r * cols;
  zero(g + n, cols - n);
  return n;
}

inline float sign_of(float x) { return x > 0.f ? 1.f : (x < 0.f ? -1.f : 0.f); }

// 2^x inline (vectorised with the loop, no library call): x = n + f, |f| <= 1/2, a degree-6
// polynomial for 2^f (relative error below 1e-7 on [-126, 128)), n added to the exponent bits.
// Arguments below -126 give 0: the exact value is below the smallest normal float, and a
// subnormal result would make every later product that reads it (the tiles' GEMMs) many times
// slower; weights that small are 0 in every sum here.
inline float fast_exp2(float x) {
  const bool under = x < -126.f;
  x = under ? -126.f : (x > 127.f ? 127.f : x);
  const float n = std::nearbyint(x);
  const float f = x - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, sizeof p);
  return under ? 0.f : p;
}

// log2(x) for x > 0 inline: x = 2^k·m with m in [√½, √2), log m = 2·atanh(z), z = (m − 1)/(m + 1)
// (|z| <= 0.172), the series to z^9 (truncation below 1e-9 relative).
inline float fast_log2(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int32_t k = ((bits >> 23) & 0xff) - 127;
  bits = (bits & 0x007fffff) | 0x3f800000;  // m in [1, 2)
  float m;
  std::memcpy(&m, &bits, sizeof m);
  const bool big = m > 1.41421356f;  // a select, not a branch: the loops vectorise
  m = big ? 0.5f * m : m;
  k += big ? 1 : 0;
  const float z = (m - 1.f) / (m + 1.f), z2 = z * z;
  float p = 1.f / 9.f;
  p = p * z2 + 1.f / 7.f;
  p = p * z2 + 1.f / 5.f;
  p = p * z2 + 1.f / 3.f;
  p = p * z2 + 1.f;
  return static_cast<float>(k) + 2.885390081777927f * z * p;  // 2/ln 2 · atanh(z)
}

// Adaptive temperature's sums over a row of base-2 scores x relative to m: Z = Σ 2^{x−m} and
// A = Σ 2^{x−m}·(x − m).
inline void exp_moments(const float* x, int64_t n, float m, float& z, float& a) {
  float zs = 0.f, as = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float d = x[j] - m;
    const float e = fast_exp2(d);
    zs += e;
    as += e * d;
  }
  z = zs;
  a = as;
}

constexpr float kLog2e = 1.4426950408889634f;

inline float fast_exp(float x) { return fast_exp2(x * kLog2e); }

// e^x − 1 without cancellation near 0: the Taylor series to x^8/8! for |x| < 1/2 (truncation
// below 2.5e-9 relative), e^x − 1 beyond (no cancellation there).
inline float fast_expm1(float x) {
  if (std::fabs(x) < 0.5f) {
    float p = 1.f / 40320.f;
    p = p * x + 1.f / 5040.f;
    p = p * x + 1.f / 720.f;
    p = p * x + 1.f / 120.f;
    p = p * x + 1.f / 24.f;
    p = p * x + 1.f / 6.f;
    p = p * x + 0.5f;
    p = p * x + 1.f;
    return p * x;
  }
  return fast_exp(x) - 1.f;
}

// softpick's d = A·expm1(s − c) + B for a row reference m (normalizers/kernels.py, _SoftpickTiles): c = 0,
// A = e^{−m}, B = 0 while m <= shift_above, else c = m, A = 1, B = 1 − e^{−m}.
struct Shift {
  float c, A, B;
};

inline Shift softpick_shift(float m, float shift_above) {
  const bool far = m > shift_above;
  const float c = far ? m : 0.f;
  return {c, std::exp(c - m), far ? -std::expm1(-m) : 0.f};
}

// t^W for a whole W (a product the compiler unrolls), or t^p (powf) for W = 0; t >= 0.
template <int W>
inline float power_of(float t, float p) {
  if constexpr (W == 0) {
    return t > 0.f ? std::pow(t, p) : 0.f;
  } else {
    float r = t;
    for (int i = 1; i < W; ++i) r *= t;
    return r;
  }
}

// power's p as a whole number up to 4 (its default is 3), or 0 for any other p.
inline int whole_power(float p) {
  return (p >= 1.f && p <= 4.f && p == std::nearbyint(p)) ? static_cast<int>(p) : 0;
}

// f(std::integral_constant<int, W>) for W = `whole` (1-4), or W = 0 for any other p: the loops
// below are instantiated per whole power, so t^W is a few products.
template <typename F>
inline auto with_power(int whole, F&& f) {
  switch (whole) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// power's forward on one row: u = (ReLU(s)/m)^p written over x; returns Σ u.
template <int W>
float power_forward(float* x, int64_t n, float inv, float p) {
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float t = x[j] > 0.f ? x[j] * inv : 0.f;
    const float u = power_of<W>(t, p);
    sum += u;
    x[j] = u;
  }
  return sum;
}

inline float power_forward_row(float* x, int64_t n, float inv, float p, int whole) {
  return with_power(whole, [&](auto w) { return power_forward<decltype(w)::value>(x, n, inv, p); });
}

// power's backward on one row: dL/ds = (dP − D)·p·(t)^{p−1}/(m·Z) over x, w = t^p/Z, t = ReLU(s)/m.
template <int W>
void power_backward(float* x, const float* g, float* w, int64_t n, float inv, float p, float d,
                    float k, float iz) {
  for (int64_t j = 0; j < n; ++j) {
    const float t = x[j] > 0.f ? x[j] * inv : 0.f;
    float slope;
    if constexpr (W == 1) {
      slope = t > 0.f ? 1.f : 0.f;
    } else if constexpr (W == 0) {
      slope = t > 0.f ? std::pow(t, p - 1.f) : 0.f;
    } else {
      slope = power_of<W - 1>(t, p);
    }
    w[j] = power_of<W>(t, p) * iz;
    x[j] = (g[j] - d) * slope * k;
  }
}

inline void power_backward_row(float* x, const float* g, float* w, int64_t n, float inv, float p,
                               int whole, float d, float k, float iz) {
  with_power(whole, [&](auto c) { power_backward<decltype(c)::value>(x, g, w, n, inv, p, d, k, iz); });
}

// The element-wise maps' rows (their tile maths: normalizers/unnormalised.py).

inline float sigmoid_of(float x) {  // σ(x) from e^{−|x|} <= 1: no overflow at any x
  const float e = fast_exp(-std::fabs(x));
  return (x >= 0.f ? 1.f : e) / (1.f + e);
}

template <int W>
void relu_forward(float* x, int64_t n, float p, float inv) {
  for (int64_t j = 0; j < n; ++j) {
    const float t = x[j] > 0.f ? x[j] : 0.f;
    x[j] = power_of<W>(t, p) * inv;
  }
}

template <int W>
void relu_backward(float* x, float* g, int64_t n, float p, float inv) {
  for (int64_t j = 0; j < n; ++j) {
    const float t = x[j] > 0.f ? x[j] : 0.f;
    float slope;
    if constexpr (W == 1) {
      slope = t > 0.f ? 1.f : 0.f;
    } else if constexpr (W == 0) {
      slope = t > 0.f ? p * std::pow(t, p - 1.f) : 0.f;
    } else {
      slope = p * power_of<W - 1>(t, p);
    }
    const float w = power_of<W>(t, p) * inv;
    x[j] = slope * g[j] * inv;
    g[j] = w;
  }
}

}  // namespace

extern "C" {

// Adaptive temperature's statistics (base-2 scores s): per row the running maximum m, Z = Σ 2^{s−m}
// and A = Σ 2^{s−m}·(s − m), updated with this tile (m, z, a read and written).
void entropy_forward(const float* s, int64_t rows, int64_t cols, const int32_t* ends,
                     int64_t tile_rows, float* m, float* z, float* a, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = s + r * cols;
    const int64_t n = visible(ends, tile_rows, r, cols);
    const float m_old = m[r];
    const float m_new = std::max(m_old, row_max(x, n, kUnseen));
    float zs, as;
    exp_moments(x, n, m_new, zs, as);
    const bool seen = m_old > kUnseen;
    const float delta = seen ? m_new - m_old : 0.f;
    const float f = seen ? fast_exp2(-delta) : 0.f;
    a[r] = (a[r] - delta * z[r]) * f + as;
    z[r] = z[r] * f + zs;
    m[r] = m_new;
  }
}

// Its backward on one tile, in place: s (base-2 scores) becomes dL/ds = (x − a)·2^x·c with
// x = s − m, per row m, a = A/Z and c = −ln 2·dL/dH / Z.
void entropy_backward(float* s, int64_t rows, int64_t cols, const int32_t* ends,
                      int64_t tile_rows, const float* m, const float* a, const float* c,
                      int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    const int64_t n = visible(ends, tile_rows, r, cols);
    const float mr = m[r], ar = a[r], cr = c[r];
    for (int64_t j = 0; j < n; ++j) {
      const float d = x[j] - mr;
      x[j] = (d - ar) * fast_exp2(d) * cr;
    }
    zero(x + n, cols - n);
  }
}

// Adaptive temperature's forward on whole rows (base-2 scores s, every key a row sees in this
// call; attention/cpu/adaptive_tiled.py): per row m = max s, Z = Σ 2^{s−m}, a = Σ 2^{s−m}·(s − m)/Z,
// H = ln 2·(log₂ Z − a), β = max(poly(H), floor) where H > threshold, else 1 (the `degree` + 1
// coefficients highest power first: normalizers/softmax.py, beta_from_entropy), then
// x = 2^{β·(s − m) − c} written over s (0 past ends) with c = max_j β·(s_j − m) and
// total = Σ_j x_j. A row with no key gets m = −FLT_MAX, Z = a = c = total = 0, β = 1.
void adaptive_forward(float* s, int64_t rows, int64_t cols, const int32_t* ends,
                      int64_t tile_rows, const float* coef, int degree, float threshold,
                      float floor, float* m, float* z, float* a, float* beta, float* shift,
                      float* total, int threads) {
  constexpr float kLn2 = 0.6931471805599453f;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* x;
    const int64_t n = forward_row(s, r, cols, ends, tile_rows, x);
    if (n == 0) {
      m[r] = -3.4028234663852886e38f;
      z[r] = a[r] = shift[r] = total[r] = 0.f;
      beta[r] = 1.f;
      continue;
    }
    const float mr = row_max(x, n, kUnseen);
    float zs, as;
    exp_moments(x, n, mr, zs, as);
    const float ar = as / zs;
    float hr = kLn2 * (std::log2(zs) - ar);
    hr = hr > 0.f ? hr : 0.f;
    float poly = 0.f;
    for (int i = 0; i <= degree; ++i) poly = poly * hr + coef[i];
    const float br = hr > threshold ? (poly > floor ? poly : floor) : 1.f;
    // β·(s − m) is largest at the row's maximum for β >= 0 (0 there), at its minimum for β < 0
    const float c = br < 0.f ? br * (-row_max_neg(x, n) - mr) : 0.f;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = fast_exp2(br * (x[j] - mr) - c);
      sum += e;
      x[j] = e;
    }
    m[r] = mr;
    z[r] = zs;
    a[r] = ar;
    beta[r] = br;
    shift[r] = c;
    total[r] = sum;
  }
}

// Its backward on whole rows: with dp = dO·vᵀ, per row m, Z, a = A/Z (entropy_forward), β, c,
// Z' = Σ_j x_j (adaptive_forward), D = dO·out and β'(H): w = 2^{β·(s − m) − c}/Z' written over dp,
// dL/ds (natural-log scores) over s: β·w·(dp − D) − g_H·ln 2·p_j·(s_j − m − a), p = 2^{s − m}/Z,
// g_H = β'(H)·dL/dβ and dL/dβ = ln 2·Σ_j (s_j − m)·w_j·(dp_j − D) (0 where β' is 0).
void tempered_backward(float* s, float* dp, int64_t rows, int64_t cols, const int32_t* ends,
                       int64_t tile_rows, const float* m, const float* z, const float* a,
                       const float* beta, const float* c, const float* total, const float* dd,
                       const float* dbeta, int threads) {
  constexpr float kLn2 = 0.6931471805599453f;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float *x, *g;
    const int64_t n = backward_row(s, dp, r, cols, ends, tile_rows, x, g);
    const float mr = m[r], br = beta[r], cr = c[r], dr = dd[r], ar = a[r];
    const float izt = total[r] > 0.f ? 1.f / total[r] : 0.f;
    const float iz = z[r] > 0.f ? 1.f / z[r] : 0.f;
    float gh = 0.f;
    if (dbeta[r] != 0.f) {
      float gb = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float d = x[j] - mr;
        gb += d * fast_exp2(br * d - cr) * (g[j] - dr);
      }
      gh = dbeta[r] * kLn2 * gb * izt;
    }
    if (gh != 0.f) {
      const float k = gh * kLn2 * iz;
      for (int64_t j = 0; j < n; ++j) {
        const float d = x[j] - mr;
        const float w = fast_exp2(br * d - cr) * izt;
        x[j] = br * w * (g[j] - dr) - k * fast_exp2(d) * (d - ar);
        g[j] = w;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const float w = fast_exp2(br * (x[j] - mr) - cr) * izt;
        x[j] = br * w * (g[j] - dr);
        g[j] = w;
      }
    }
  }
}

}  // extern "C"

namespace {

// The element-wise and row-normalised maps, one struct each (their PyTorch tile maths:
// `TileMaths` in normalizers/unnormalised.py and normalizers/kernels.py), and the loops that
// walk a tile with one of them. A new map is a struct here and one ELEMENTWISE or NORMALISED
// line below, which names its loops as its kernel record (`families.Kernel`) does.
//
// Element-wise: row(x, n, p, r) writes w = f(s) over x, with r the row's value; grad(x, g, n,
// p, r) writes dL/ds over x and w over g (g = dO·vᵀ).

struct Sigmoid {  // w = σ(s + b), b = r
  static void row(float* x, int64_t n, float, float b) {
    for (int64_t j = 0; j < n; ++j) x[j] = sigmoid_of(x[j] + b);
  }
  static void grad(float* x, float* g, int64_t n, float, float b) {
    for (int64_t j = 0; j < n; ++j) {
      const float w = sigmoid_of(x[j] + b);
      x[j] = w * (1.f - w) * g[j];
      g[j] = w;
    }
  }
};

struct Relu {  // w = ReLU(s)^p / n, n = r (>= 1)
  static void row(float* x, int64_t n, float p, float r) {
    const float inv = 1.f / r;
    with_power(whole_power(p), [&](auto w) { relu_forward<decltype(w)::value>(x, n, p, inv); });
  }
  static void grad(float* x, float* g, int64_t n, float p, float r) {
    const float inv = 1.f / r;
    with_power(whole_power(p), [&](auto w) { relu_backward<decltype(w)::value>(x, g, n, p, inv); });
  }
};

// Normalised by a row sum, w = u/Z with Z = Σ a, u and a relative to a running row reference m:
// row(x, n, p, shift, m, f) moves m to the new reference (read and written), sets f, the factor
// that rescales sums taken relative to the old one, writes u over x and returns Σ a;
// grad(x, g, w, n, p, shift, m, d, z) writes dL/ds over x and w with D = d = dO·out;
// kStart is the reference before any key, factor(m, m', p) the rescaling from m to m' (which
// row's f is, and with which a decoding step combines its runs of keys).

struct Power {  // u = a = (ReLU(s)/m)^p, m the largest ReLU(s) (1 while it is 0)
  static constexpr float kStart = 0.f;
  static float factor(float m, float m_new, float p) {
    return std::pow(m / (m_new > 0.f ? m_new : 1.f), p);
  }
  static float row(float* x, int64_t n, float p, float, float& m, float& f) {
    const float m_new = std::max(m, row_max(x, n, 0.f));
    const float m1 = m_new > 0.f ? m_new : 1.f;
    f = factor(m, m_new, p);
    m = m_new;
    return power_forward_row(x, n, 1.f / m1, p, whole_power(p));
  }
  static void grad(float* x, const float* g, float* w, int64_t n, float p, float, float m,
                   float d, float z) {
    const float m1 = m > 0.f ? m : 1.f;
    power_backward_row(x, g, w, n, 1.f / m1, p, whole_power(p), d, p / (m1 * z), 1.f / z);
  }
};

struct Signed {  // u = sign(s)·e^{|s| − m}, a = e^{|s| − m}, m the largest |s|
  static constexpr float kStart = 0.f;
  static float factor(float m, float m_new, float) { return std::exp(m - m_new); }
  static float row(float* x, int64_t n, float, float, float& m, float& f) {
    const float m_new = std::max(m, row_abs_max(x, n));
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = fast_exp(std::fabs(x[j]) - m_new);
      sum += e;
      x[j] = e * sign_of(x[j]);
    }
    f = factor(m, m_new, 0.f);
    m = m_new;
    return sum;
  }
  static void grad(float* x, const float* g, float* w, int64_t n, float, float, float m,
                   float d, float z) {
    const float iz = 1.f / z;
    for (int64_t j = 0; j < n; ++j) {
      const float sg = sign_of(x[j]);
      const float wj = fast_exp(std::fabs(x[j]) - m) * iz * sg;
      w[j] = wj;
      x[j] = (g[j] * sg - d) * wj;
    }
  }
};

struct Softpick {  // d = A·expm1(s − c) + B, u = ReLU(d), a = |d|, m = max(0, max s)
  static constexpr float kStart = 0.f;
  static float factor(float m, float m_new, float) { return std::exp(m - m_new); }
  static float row(float* x, int64_t n, float, float shift, float& m, float& f) {
    const float m_new = std::max(m, row_max(x, n, 0.f));
    const Shift sh = softpick_shift(m_new, shift);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float d = sh.A * fast_expm1(x[j] - sh.c) + sh.B;
      sum += std::fabs(d);
      x[j] = d > 0.f ? d : 0.f;
    }
    f = factor(m, m_new, 0.f);
    m = m_new;
    return sum;
  }
  static void grad(float* x, const float* g, float* w, int64_t n, float, float shift, float m,
                   float dd, float z) {
    const Shift sh = softpick_shift(m, shift);
    const float iz = 1.f / z;
    for (int64_t j = 0; j < n; ++j) {
      const float d = sh.A * fast_expm1(x[j] - sh.c) + sh.B;
      const float pos = d > 0.f ? 1.f : 0.f;
      w[j] = pos * d * iz;
      x[j] = (pos * g[j] - sign_of(d) * dd) * (d + (sh.A - sh.B)) * iz;
    }
  }
};

// StableMax (Prieto et al. 2025): s(x) = x + 1 for x >= 0, 1/(1 − x) below; u = a = s(x)/m, m the
// largest s(x) (s is increasing: s of the largest score), ds = (dP − D)·s′(x)/(m·Z) with
// s′(x) = 1 for x >= 0, 1/(1 − x)² below.
inline float stablemax_of(float x) { return x >= 0.f ? x + 1.f : 1.f / (1.f - x); }

struct Stablemax {
  static constexpr float kStart = 0.f;
  static float factor(float m, float m_new, float) { return m * (m_new > 0.f ? 1.f / m_new : 1.f); }
  static float row(float* x, int64_t n, float, float, float& m, float& f) {
    const float m_new = n > 0 ? std::max(m, stablemax_of(row_max(x, n, kUnseen))) : m;
    const float inv = m_new > 0.f ? 1.f / m_new : 1.f;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float u = stablemax_of(x[j]) * inv;
      sum += u;
      x[j] = u;
    }
    f = factor(m, m_new, 0.f);
    m = m_new;
    return sum;
  }
  static void grad(float* x, const float* g, float* w, int64_t n, float, float, float m,
                   float d, float z) {
    const float inv = m > 0.f ? 1.f / m : 1.f, iz = 1.f / z;
    for (int64_t j = 0; j < n; ++j) {
      const float xj = x[j], below = 1.f / (1.f - std::min(xj, 0.f));
      const float u = (xj >= 0.f ? xj + 1.f : below) * inv;
      const float slope = (xj >= 0.f ? 1.f : below * below) * inv;
      w[j] = u * iz;
      x[j] = (g[j] - d) * slope * iz;
    }
  }
};

// The loops: a tile of B·H·r rows of `cols` keys (each row its prefix of `ends`, if given).

template <class Map>
void elementwise_forward(float p, float* s, int64_t rows, int64_t cols, const int32_t* ends,
                         int64_t tile_rows, const float* row, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* x;
    const int64_t n = forward_row(s, r, cols, ends, tile_rows, x);
    Map::row(x, n, p, row[r]);
  }
}

template <class Map>
void elementwise_backward(float p, float* s, float* dp, int64_t rows, int64_t cols,
                          const int32_t* ends, int64_t tile_rows, const float* row, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float *x, *g;
    const int64_t n = backward_row(s, dp, r, cols, ends, tile_rows, x, g);
    Map::grad(x, g, n, p, row[r]);
  }
}

template <class Map>
void normalised_forward(float p, float shift, float* s, int64_t rows, int64_t cols,
                        const int32_t* ends, int64_t tile_rows, float* m, float* f, float* total,
                        int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* x;
    const int64_t n = forward_row(s, r, cols, ends, tile_rows, x);
    total[r] = Map::row(x, n, p, shift, m[r], f[r]);
  }
}

template <class Map>
void normalised_backward(float p, float shift, float* s, const float* dp, float* w, int64_t rows,
                         int64_t cols, const int32_t* ends, int64_t tile_rows, const float* m,
                         const float* dd, const float* z, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    float* wr = w + r * cols;
    const int64_t n = visible(ends, tile_rows, r, cols);
    zero(x + n, cols - n);
    zero(wr + n, cols - n);
    Map::grad(x, dp + r * cols, wr, n, p, shift, m[r], dd[r], z[r]);
  }
}

// softmax as a normalised map, u = a = e^{s − m}, m the largest score (kUnseen while none is
// seen): the softmax family's rows in a decoding step (its tiles run torch's flash kernel).
struct Softmax {
  static constexpr float kStart = kUnseen;
  static float factor(float m, float m_new, float) {
    return m > kUnseen ? fast_exp(m - m_new) : 0.f;
  }
  static float row(float* x, int64_t n, float, float, float& m, float& f) {
    const float m_new = std::max(m, row_max(x, n, kUnseen));
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = fast_exp(x[j] - m_new);
      sum += e;
      x[j] = e;
    }
    f = factor(m, m_new, 0.f);
    m = m_new;
    return sum;
  }
};

// The largest |x| over the floats given to `add`, as bits with the sign cleared: finite values
// order as their magnitudes do, and every infinity or NaN lies above them all (0x7f800000 and
// up). Bits, not float compares, so that -ffast-math cannot assume the NaN away; one lane per
// vector slot, reduced once by `top`.
struct AbsTop {
  uint32_t lane[16] = {};
  // n floats at x; N: n where the caller knows it (a multiple of 16), else 0
  template <int N = 0>
  void add(const float* x, int64_t n) {
    const int64_t full = N > 0 ? N : n - n % 16;
    for (int64_t d = 0; d < full; d += 16)
      for (int k = 0; k < 16; ++k) {
        uint32_t b;
        std::memcpy(&b, x + d + k, sizeof b);
        b &= 0x7fffffffu;
        lane[k] = lane[k] > b ? lane[k] : b;
      }
    if constexpr (N == 0)
      for (int64_t d = full; d < n; ++d) {
        uint32_t b;
        std::memcpy(&b, x + d, sizeof b);
        b &= 0x7fffffffu;
        lane[0] = lane[0] > b ? lane[0] : b;
      }
  }
  uint32_t top() const {
    uint32_t t = 0u;
    for (int k = 0; k < 16; ++k) t = t > lane[k] ? t : lane[k];
    return t;
  }
};

// A decoding step in one parallel region: the R = G·Lq query rows of each key head (its G query
// heads, Lq rows each) against a cache of Lk keys split into `runs` runs. Each (batch, key head,
// run) is one unit of work: over chunks of kChunk keys, its rows' scores (each key row read
// once), the map, and Σ w·v over the same keys (each value row read once); a normalised map keeps
// a running reference per row, as the tiles do. Then each row's runs are combined (a normalised
// map's sums rescaled to the largest reference, as flash decoding combines softmax's). While the
// keys and values pass, their largest magnitudes are kept (`AbsTop`): mags[0] = max |k| and
// mags[1] = max |v| over the whole cache, infinite or NaN where any value is, so the caller
// checks its inputs without reading the cache a second time; mags[2] = the largest |score| (q as
// given, scale and row factors on it: the largest |β·s| of the row-scaled family), infinite where
// one overflows.
//
// dims: B, H, Hkv, Lq, Lk, D, Dv, runs; strides (in floats): k's batch, head and key, then v's;
// q [B, H, Lq, D] contiguous and already scaled; ends[i]: the keys row i sees (a prefix; null:
// all); row [B, H, Lq]: the element-wise maps' row values; part: B·Hkv·runs·R·(Dv + 2) floats of
// scratch; out [B, H, Lq, Dv]; m_out and z_out [B, H, Lq] (normalised maps: the row's reference
// and Σ a relative to it).
constexpr int64_t kChunk = 256;

template <class Map, bool kNormalised>
constexpr float start() {
  if constexpr (kNormalised) return Map::kStart;
  return 0.f;
}

// Σ a_d·b_d over n floats, in 16 lanes; N: n where the caller knows it (a multiple of 16), else 0.
template <int N>
inline float dot_lanes(const float* a, const float* b, int64_t n) {
  float lane[16] = {};
  const int64_t full = N > 0 ? N : n - n % 16;
  for (int64_t d = 0; d < full; d += 16)
    for (int k = 0; k < 16; ++k) lane[k] += a[d + k] * b[d + k];
  float s = 0.f;
  if constexpr (N == 0)
    for (int64_t d = full; d < n; ++d) s += a[d] * b[d];
  for (int k = 0; k < 16; ++k) s += lane[k];
  return s;
}

// pr[d] += Σ_j w_j·v_j[d] over the n value rows at v (`stride` floats apart, Dv each), zero
// weights skipped, the sums in registers where the head size kD is known. (decode_step keeps its
// own copy of this loop, which also checks each value row on its first query row: through a
// shared helper that check measured 25% slower at 4,096 keys.)
template <int kD>
inline void weigh_into(float* pr, const float* w, const float* v, int64_t n, int64_t stride,
                       int64_t Dv) {
  if constexpr (kD > 0) {
    float acc[kD] = {};
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.f) continue;
      const float* vj = v + j * stride;
      for (int64_t d = 0; d < kD; ++d) acc[d] += w[j] * vj[d];
    }
    for (int64_t d = 0; d < kD; ++d) pr[d] += acc[d];
  } else {
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.f) continue;
      const float* vj = v + j * stride;
      for (int64_t d = 0; d < Dv; ++d) pr[d] += w[j] * vj[d];
    }
  }
}

// The largest of each unit's magnitudes, as mags (k, v, score), each 0 where not given.
inline void write_mags(float* mags, const std::vector<uint32_t>* k, const std::vector<uint32_t>* v,
                       uint32_t score) {
  uint32_t top[3] = {0u, 0u, score};
  for (int i = 0; i < 2; ++i) {
    const std::vector<uint32_t>* bits = i == 0 ? k : v;
    if (bits != nullptr)
      for (uint32_t b : *bits) top[i] = std::max(top[i], b);
  }
  std::memcpy(mags, top, sizeof top);
}

// kD: the head size where it is 64 or 128 for k and v both (the loops then know their length),
// else 0 (read from dims)
template <class Map, bool kNormalised, int kD>
void decode_step(float p, float shift, const float* q, const float* k, const float* v,
                 const int64_t* dims, const int64_t* strides, const int32_t* ends,
                 const float* row, float* part, float* out, float* m_out, float* z_out,
                 float* mags, int threads) {
  const int64_t B = dims[0], H = dims[1], Hkv = dims[2], Lq = dims[3], Lk = dims[4];
  const int64_t D = kD ? kD : dims[5], Dv = kD ? kD : dims[6], S = dims[7];
  const int64_t G = H / Hkv, R = G * Lq, run = (Lk + S - 1) / S, units = B * Hkv * S;
  const int64_t width = Dv + 2;  // per row of a unit: Σ w·v, then the reference m and Σ a
  std::vector<uint32_t> kbits(units, 0u), vbits(units, 0u), sbits(units, 0u);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sc(R * kChunk);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b = u / (Hkv * S), hk = (u / S) % Hkv, s = u % S;
      const int64_t j0 = std::min(Lk, s * run), j1 = std::min(Lk, j0 + run);
      const float* qu = q + (b * H + hk * G) * Lq * D;
      const float* ku = k + b * strides[0] + hk * strides[1];
      const float* vu = v + b * strides[3] + hk * strides[4];
      float* pu = part + u * R * width;
      for (int64_t r = 0; r < R; ++r) {
        zero(pu + r * width, Dv);
        pu[r * width + Dv] = start<Map, kNormalised>();
        pu[r * width + Dv + 1] = 0.f;
      }
      AbsTop kt, vt, st;
      for (int64_t c0 = j0; c0 < j1; c0 += kChunk) {
        const int64_t cn = std::min(j1, c0 + kChunk) - c0;
        for (int64_t j = 0; j < cn; ++j) {
          const float* kj = ku + (c0 + j) * strides[2];
          kt.add<kD>(kj, D);
          for (int64_t r = 0; r < R; ++r) sc[r * kChunk + j] = dot_lanes<kD>(qu + r * D, kj, D);
        }
        for (int64_t r = 0; r < R; ++r) st.add(sc.data() + r * kChunk, cn);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t i = r % Lq;
          const int64_t n =
              ends == nullptr ? cn : std::min<int64_t>(cn, std::max<int64_t>(0, ends[i] - c0));
          float* x = sc.data() + r * kChunk;
          float* pr = pu + r * width;
          if constexpr (kNormalised) {
            float f;
            const float total = Map::row(x, n, p, shift, pr[Dv], f);
            for (int64_t d = 0; d < Dv; ++d) pr[d] *= f;
            pr[Dv + 1] = pr[Dv + 1] * f + total;
          } else {
            Map::row(x, n, p, row[(b * H + hk * G + r / Lq) * Lq + i]);
          }
          zero(x + n, cn - n);  // keys the row does not see weigh nothing
        }
        // Σ w·v row by row, the sums in registers (each value row checked on the first)
        for (int64_t r = 0; r < R; ++r) {
          const float* w = sc.data() + r * kChunk;
          float* pr = pu + r * width;
          if constexpr (kD > 0) {
            float acc[kD] = {};
            for (int64_t j = 0; j < cn; ++j) {
              const float* vj = vu + (c0 + j) * strides[5];
              if (r == 0) vt.add<kD>(vj, Dv);
              if (w[j] == 0.f) continue;
              for (int64_t d = 0; d < kD; ++d) acc[d] += w[j] * vj[d];
            }
            for (int64_t d = 0; d < kD; ++d) pr[d] += acc[d];
          } else {
            for (int64_t j = 0; j < cn; ++j) {
              const float* vj = vu + (c0 + j) * strides[5];
              if (r == 0) vt.add(vj, Dv);
              if (w[j] == 0.f) continue;
              for (int64_t d = 0; d < Dv; ++d) pr[d] += w[j] * vj[d];
            }
          }
        }
      }
      kbits[u] = kt.top();
      vbits[u] = vt.top();
      sbits[u] = st.top();
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < B * Hkv * R; ++t) {
      const int64_t b = t / (Hkv * R), hk = (t / R) % Hkv, r = t % R;
      const int64_t at = (b * H + hk * G + r / Lq) * Lq + r % Lq;  // the row in [B, H, Lq]
      const float* first = part + (b * Hkv + hk) * S * R * width + r * width;
      float* o = out + at * Dv;
      zero(o, Dv);
      float mref = start<Map, kNormalised>(), z = 0.f;
      if constexpr (kNormalised)
        for (int64_t s = 0; s < S; ++s) mref = std::max(mref, first[s * R * width + Dv]);
      for (int64_t s = 0; s < S; ++s) {
        const float* pr = first + s * R * width;
        float f = 1.f;
        if constexpr (kNormalised) f = Map::factor(pr[Dv], mref, p);
        for (int64_t d = 0; d < Dv; ++d) o[d] += f * pr[d];
        z += f * pr[Dv + 1];
      }
      if constexpr (kNormalised) {
        const float iz = z > 0.f ? 1.f / z : 1.f;
        for (int64_t d = 0; d < Dv; ++d) o[d] *= iz;
        m_out[at] = mref;
        z_out[at] = z;
      }
    }
  }
  write_mags(mags, &kbits, &vbits, *std::max_element(sbits.begin(), sbits.end()));
}

template <class Map, bool kNormalised>
void decode_sized(float p, float shift, const float* q, const float* k, const float* v,
                  const int64_t* dims, const int64_t* strides, const int32_t* ends,
                  const float* row, float* part, float* out, float* m_out, float* z_out,
                  float* mags, int threads) {
  const int64_t d = dims[5] == dims[6] ? dims[5] : 0;
  auto step = d == 64    ? decode_step<Map, kNormalised, 64>
              : d == 128 ? decode_step<Map, kNormalised, 128>
                         : decode_step<Map, kNormalised, 0>;
  step(p, shift, q, k, v, dims, strides, ends, row, part, out, m_out, z_out, mags, threads);
}

}  // namespace

// The exported loops of each map: `elementwise_forward_NAME` and `elementwise_backward_NAME`, or
// `normalised_forward_NAME` and `normalised_backward_NAME` (attention/cpu/native.py calls them by
// the name of the map's kernel record).
#define DECODE(NAME, Map, NORMALISED)                                                             \
  extern "C" void decode_##NAME(float p, float shift, const float* q, const float* k,            \
                                const float* v, const int64_t* dims, const int64_t* strides,     \
                                const int32_t* ends, const float* row, float* part, float* out,  \
                                float* m_out, float* z_out, float* mags, int threads) {          \
    decode_sized<Map, NORMALISED>(p, shift, q, k, v, dims, strides, ends, row, part, out, m_out, \
                                  z_out, mags, threads);                                         \
  }

#define ELEMENTWISE(NAME, Map)                                                                    \
  extern "C" void elementwise_forward_##NAME(float p, float* s, int64_t rows, int64_t cols,      \
                                             const int32_t* ends, int64_t tile_rows,             \
                                             const float* row, int threads) {                    \
    elementwise_forward<Map>(p, s, rows, cols, ends, tile_rows, row, threads);                   \
  }                                                                                               \
  extern "C" void elementwise_backward_##NAME(float p, float* s, float* dp, int64_t rows,         \
                                              int64_t cols, const int32_t* ends,                 \
                                              int64_t tile_rows, const float* row, int threads) { \
    elementwise_backward<Map>(p, s, dp, rows, cols, ends, tile_rows, row, threads);              \
  }                                                                                               \
  DECODE(NAME, Map, false)

#define NORMALISED(NAME, Map)                                                                     \
  extern "C" void normalised_forward_##NAME(float p, float shift, float* s, int64_t rows,        \
                                            int64_t cols, const int32_t* ends,                   \
                                            int64_t tile_rows, float* m, float* f, float* total, \
                                            int threads) {                                       \
    normalised_forward<Map>(p, shift, s, rows, cols, ends, tile_rows, m, f, total, threads);     \
  }                                                                                               \
  extern "C" void normalised_backward_##NAME(float p, float shift, float* s, const float* dp,    \
                                             float* w, int64_t rows, int64_t cols,               \
                                             const int32_t* ends, int64_t tile_rows,             \
                                             const float* m, const float* dd, const float* z,    \
                                             int threads) {                                      \
    normalised_backward<Map>(p, shift, s, dp, w, rows, cols, ends, tile_rows, m, dd, z,          \
                             threads);                                                           \
  }                                                                                               \
  DECODE(NAME, Map, true)

ELEMENTWISE(sigmoid, Sigmoid)
ELEMENTWISE(relu, Relu)
NORMALISED(power, Power)
NORMALISED(signed, Signed)
NORMALISED(softpick, Softpick)
NORMALISED(stablemax, Stablemax)
DECODE(softmax, Softmax, true)

namespace {

// Adaptive temperature in a decoding step: adaptive_forward's maths over a cache split into runs
// of keys, in one parallel region. q carries scale·log₂e (base-2 scores). Each (batch, key head,
// run) unit computes its rows' scores (each key row read once, kept in `scores`: B·Hkv·runs·R·run
// floats) and their m, Z = Σ 2^{s−m}, A = Σ 2^{s−m}·(s − m) and min s. Each row combines its runs
// (Z and A moved to the row's largest m: Z_s·2^{m_s−m} and 2^{m_s−m}·(A_s + (m_s − m)·Z_s)) into
// H = ln 2·(log₂ Z − A/Z), β = max(poly(H), floor) where H > threshold, else 1, and the shift c
// (β·(min s − m) for β < 0, else 0); then each unit weighs its stored scores, 2^{β·(s − m) − c},
// and sums them and Σ w·v (each value row read once), and each row adds its runs' sums. The
// largest |k| and |v| are kept as in decode_step (mags), and mags[2] is the largest |β·s| (β
// the row's own; base-2 scores).
template <int kD>
void decode_adaptive_sized(const float* q, const float* k, const float* v, const int64_t* dims,
                           const int64_t* strides, const int32_t* ends, const float* coef,
                           int degree, float threshold, float floor, float* scores, float* part,
                           float* rowstats, float* out, float* mags, int threads) {
  constexpr float kLn2 = 0.6931471805599453f;
  const int64_t B = dims[0], H = dims[1], Hkv = dims[2], Lq = dims[3], Lk = dims[4];
  const int64_t D = kD ? kD : dims[5], Dv = kD ? kD : dims[6], S = dims[7];
  const int64_t G = H / Hkv, R = G * Lq, run = (Lk + S - 1) / S, units = B * Hkv * S;
  const int64_t width = Dv + 5;  // per row of a unit: Σ w·v, Σ w, then m, Z, A, min s
  std::vector<uint32_t> kbits(units, 0u), vbits(units, 0u);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {  // the scores and their moments
      const int64_t b = u / (Hkv * S), hk = (u / S) % Hkv, s = u % S;
      const int64_t j0 = std::min(Lk, s * run), len = std::min(Lk, j0 + run) - j0;
      const float* qu = q + (b * H + hk * G) * Lq * D;
      const float* ku = k + b * strides[0] + hk * strides[1];
      float* su = scores + u * R * run;
      for (int64_t r = 0; r < R; ++r) {
        float* pr = part + (u * R + r) * width;
        pr[Dv + 1] = kUnseen;
        pr[Dv + 2] = pr[Dv + 3] = pr[Dv + 4] = 0.f;
      }
      AbsTop kt;
      for (int64_t c0 = 0; c0 < len; c0 += kChunk) {  // chunks in cache: running moments
        const int64_t cn = std::min(len, c0 + kChunk) - c0;
        for (int64_t j = c0; j < c0 + cn; ++j) {
          const float* kj = ku + (j0 + j) * strides[2];
          kt.add<kD>(kj, D);
          for (int64_t r = 0; r < R; ++r) su[r * run + j] = dot_lanes<kD>(qu + r * D, kj, D);
        }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t end = ends == nullptr ? len : std::min<int64_t>(len, std::max<int64_t>(0, ends[r % Lq] - j0));
          const int64_t n = std::min<int64_t>(cn, std::max<int64_t>(0, end - c0));
          if (n == 0) continue;
          const float* x = su + r * run + c0;
          float* pr = part + (u * R + r) * width;
          const float m_old = pr[Dv + 1], m_new = std::max(m_old, row_max(x, n, kUnseen));
          const bool seen = m_old > kUnseen;
          const float lo = -row_max_neg(x, n);
          float zs, as;
          exp_moments(x, n, m_new, zs, as);
          const float delta = seen ? m_new - m_old : 0.f, f = seen ? fast_exp2(-delta) : 0.f;
          pr[Dv + 3] = (pr[Dv + 3] - delta * pr[Dv + 2]) * f + as;
          pr[Dv + 2] = pr[Dv + 2] * f + zs;
          pr[Dv + 4] = seen ? std::min(pr[Dv + 4], lo) : lo;
          pr[Dv + 1] = m_new;
        }
      }
      kbits[u] = kt.top();
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < B * Hkv * R; ++t) {  // each row's β from its runs' moments
      const int64_t bk = t / R, r = t % R;
      const float* first = part + (bk * S * R + r) * width;
      float m = kUnseen, lo = 0.f;
      bool seen = false;
      for (int64_t s = 0; s < S; ++s) {
        const float* pr = first + s * R * width;
        if (pr[Dv + 1] <= kUnseen) continue;
        lo = seen ? std::min(lo, pr[Dv + 4]) : pr[Dv + 4];
        m = std::max(m, pr[Dv + 1]);
        seen = true;
      }
      float z = 0.f, a = 0.f;
      for (int64_t s = 0; s < S && seen; ++s) {
        const float* pr = first + s * R * width;
        if (pr[Dv + 1] <= kUnseen) continue;
        const float f = fast_exp2(pr[Dv + 1] - m);
        z += pr[Dv + 2] * f;
        a += (pr[Dv + 3] + (pr[Dv + 1] - m) * pr[Dv + 2]) * f;
      }
      float beta = 1.f, c = 0.f;
      if (seen) {
        float h = kLn2 * (std::log2(z) - a / z);
        h = h > 0.f ? h : 0.f;
        float poly = 0.f;
        for (int i = 0; i <= degree; ++i) poly = poly * h + coef[i];
        beta = h > threshold ? (poly > floor ? poly : floor) : 1.f;
        c = beta < 0.f ? beta * (lo - m) : 0.f;
      }
      float* rs = rowstats + t * 4;
      rs[0] = seen ? m : kUnseen;
      rs[1] = beta;
      rs[2] = c;
      rs[3] = seen ? std::fabs(beta) * std::max(std::fabs(m), std::fabs(lo)) : 0.f;
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {  // the weights, their sums and Σ w·v
      const int64_t b = u / (Hkv * S), hk = (u / S) % Hkv, s = u % S;
      const int64_t j0 = std::min(Lk, s * run), len = std::min(Lk, j0 + run) - j0;
      const float* vu = v + b * strides[3] + hk * strides[4];
      float* su = scores + u * R * run;
      for (int64_t r = 0; r < R; ++r) zero(part + (u * R + r) * width, Dv + 1);
      AbsTop vt;
      for (int64_t c0 = 0; c0 < len; c0 += kChunk) {  // chunks of values in cache, row by row
        const int64_t cn = std::min(len, c0 + kChunk) - c0;
        for (int64_t j = c0; j < c0 + cn; ++j) vt.add<kD>(vu + (j0 + j) * strides[5], Dv);
        for (int64_t r = 0; r < R; ++r) {
          const float* rs = rowstats + ((b * Hkv + hk) * R + r) * 4;
          if (rs[0] <= kUnseen) continue;
          const int64_t end = ends == nullptr ? len : std::min<int64_t>(len, std::max<int64_t>(0, ends[r % Lq] - j0));
          const int64_t n = std::min<int64_t>(cn, std::max<int64_t>(0, end - c0));
          float* x = su + r * run + c0;
          float* pr = part + (u * R + r) * width;
          const float m = rs[0], beta = rs[1], c = rs[2];
          float total = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            const float e = fast_exp2(beta * (x[j] - m) - c);
            total += e;
            x[j] = e;
          }
          pr[Dv] += total;
          weigh_into<kD>(pr, x, vu + (j0 + c0) * strides[5], n, strides[5], Dv);
        }
      }
      vbits[u] = vt.top();
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < B * Hkv * R; ++t) {  // each row: its runs' sums added
      const int64_t bk = t / R, r = t % R, b = bk / Hkv, hk = bk % Hkv;
      const float* first = part + (bk * S * R + r) * width;
      float* o = out + ((b * H + hk * G + r / Lq) * Lq + r % Lq) * Dv;
      zero(o, Dv);
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const float* pr = first + s * R * width;
        for (int64_t d = 0; d < Dv; ++d) o[d] += pr[d];
        total += pr[Dv];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
    }
  }
  AbsTop bs;
  for (int64_t t = 0; t < B * Hkv * R; ++t) bs.add(rowstats + t * 4 + 3, 1);
  write_mags(mags, &kbits, &vbits, bs.top());
}

}  // namespace

namespace {

// A decoding step's two products for the paths with a row rule of their own (stick-breaking,
// top-k, the entmax family): scores s = q·kᵀ [B, H, Lq, Lk] (q carrying the scale), and then
// out = w·v [B, H, Lq, Dv] from their weights w, each in one parallel region over (batch, key
// head, run of keys) units, each key and value row read once, as decode_step reads them; the
// scores keep max |k| and max |s| (mags[0], mags[2]), the values max |v| (mags[1]).
template <int kD>
void decode_scores_sized(const float* q, const float* k, const int64_t* dims,
                         const int64_t* strides, float* s, float* mags, int threads) {
  const int64_t B = dims[0], H = dims[1], Hkv = dims[2], Lq = dims[3], Lk = dims[4];
  const int64_t D = kD ? kD : dims[5], S = dims[7];
  const int64_t G = H / Hkv, R = G * Lq, run = (Lk + S - 1) / S, units = B * Hkv * S;
  std::vector<uint32_t> kbits(units, 0u), sbits(units, 0u);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t b = u / (Hkv * S), hk = (u / S) % Hkv, r0 = u % S;
    const int64_t j0 = std::min(Lk, r0 * run), j1 = std::min(Lk, j0 + run);
    const float* qu = q + (b * H + hk * G) * Lq * D;
    const float* ku = k + b * strides[0] + hk * strides[1];
    float* su = s + (b * H + hk * G) * Lq * Lk;
    AbsTop kt, st;
    for (int64_t j = j0; j < j1; ++j) {
      const float* kj = ku + j * strides[2];
      kt.add<kD>(kj, D);
      for (int64_t r = 0; r < R; ++r) su[r * Lk + j] = dot_lanes<kD>(qu + r * D, kj, D);
    }
    for (int64_t r = 0; r < R; ++r) st.add(su + r * Lk + j0, j1 - j0);
    kbits[u] = kt.top();
    sbits[u] = st.top();
  }
  write_mags(mags, &kbits, nullptr, *std::max_element(sbits.begin(), sbits.end()));
}

template <int kD>
void decode_values_sized(const float* w, const float* v, const int64_t* dims,
                         const int64_t* strides, float* part, float* out, float* mags,
                         int threads) {
  const int64_t B = dims[0], H = dims[1], Hkv = dims[2], Lq = dims[3], Lk = dims[4];
  const int64_t Dv = kD ? kD : dims[6], S = dims[7];
  const int64_t G = H / Hkv, R = G * Lq, run = (Lk + S - 1) / S, units = B * Hkv * S;
  std::vector<uint32_t> vbits(units, 0u);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b = u / (Hkv * S), hk = (u / S) % Hkv, r0 = u % S;
      const int64_t j0 = std::min(Lk, r0 * run), j1 = std::min(Lk, j0 + run);
      const float* vu = v + b * strides[3] + hk * strides[4];
      const float* wu = w + (b * H + hk * G) * Lq * Lk;
      float* pu = part + u * R * Dv;
      zero(pu, R * Dv);
      AbsTop vt;
      for (int64_t c0 = j0; c0 < j1; c0 += kChunk) {
        const int64_t c1 = std::min(j1, c0 + kChunk);
        for (int64_t j = c0; j < c1; ++j) vt.add<kD>(vu + j * strides[5], Dv);
        for (int64_t r = 0; r < R; ++r) {
          weigh_into<kD>(pu + r * Dv, wu + r * Lk + c0, vu + c0 * strides[5], c1 - c0, strides[5],
                         Dv);
        }
      }
      vbits[u] = vt.top();
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < B * Hkv * R; ++t) {
      const int64_t bk = t / R, r = t % R, b = bk / Hkv, hk = bk % Hkv;
      float* o = out + ((b * H + hk * G) * Lq + r) * Dv;
      zero(o, Dv);
      for (int64_t s = 0; s < S; ++s) {
        const float* pr = part + ((bk * S + s) * R + r) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] += pr[d];
      }
    }
  }
  write_mags(mags, nullptr, &vbits, 0u);
}

}  // namespace

extern "C" void decode_scores(const float* q, const float* k, const int64_t* dims,
                              const int64_t* strides, float* s, float* mags, int threads) {
  auto step = dims[5] == 64    ? decode_scores_sized<64>
              : dims[5] == 128 ? decode_scores_sized<128>
                               : decode_scores_sized<0>;
  step(q, k, dims, strides, s, mags, threads);
}

extern "C" void decode_values(const float* w, const float* v, const int64_t* dims,
                              const int64_t* strides, float* part, float* out, float* mags,
                              int threads) {
  auto step = dims[6] == 64    ? decode_values_sized<64>
              : dims[6] == 128 ? decode_values_sized<128>
                               : decode_values_sized<0>;
  step(w, v, dims, strides, part, out, mags, threads);
}

// The largest |x| of n floats, in one parallel pass (`attend`'s check of its inputs): infinite or
// NaN where a value is (AbsTop's bits, read back as a float).
extern "C" void abs_max(const float* x, int64_t n, float* out, int threads) {
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  uint32_t top = 0u;
#pragma omp parallel num_threads(threads)
  {
    AbsTop t;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < blocks; ++i) t.add(x + i * kBlock, std::min(kBlock, n - i * kBlock));
    const uint32_t mine = t.top();
#pragma omp critical
    top = std::max(top, mine);
  }
  std::memcpy(out, &top, sizeof top);
}

// A decoding step of adaptive temperature (decode_adaptive_sized; its head size 64 or 128 as a
// constant where k's and v's agree).
extern "C" void decode_adaptive(const float* q, const float* k, const float* v,
                                const int64_t* dims, const int64_t* strides, const int32_t* ends,
                                const float* coef, int degree, float threshold, float floor,
                                float* scores, float* part, float* rowstats, float* out,
                                float* mags, int threads) {
  const int64_t d = dims[5] == dims[6] ? dims[5] : 0;
  auto step = d == 64    ? decode_adaptive_sized<64>
              : d == 128 ? decode_adaptive_sized<128>
                         : decode_adaptive_sized<0>;
  step(q, k, v, dims, strides, ends, coef, degree, threshold, floor, scores, part, rowstats, out,
       mags, threads);
}

namespace {

// The entmax family's threshold on a slab of rows (attention/cpu/sparse_tiled.py: _solve, then
// _final_weights): `steps` safeguarded Newton steps on each row's τ from tau (read and written)
// within the bracket [lo, hi], then p = [y − τ]_+^e written over y and total = Σ p. Kind 0:
// sparsemax (e = 1, Newton on f = Σ t − 1), 1: 1.5-entmax (e = 2), 2: any other e = 1/(α − 1)
// (Newton on G = (Σ t^e)^{1/e} − 1); t = [y − τ]_+. Exported by name below (SPARSE_SOLVE).
//
// Every iterate stays in the bracket, so a key with y <= lo has t = 0 at each of them: the row's
// keys with y > lo are first copied, with their indices, into cy and ci (blocks of 16 keys
// whose maximum is <= lo are skipped whole), and the steps and the weights run over those only
// (measured at n = 4,096 with attention scores: 12% of the keys for α = 1.3, 1.3% for 1.5,
// 0.2% for sparsemax).
template <int K>
inline float weight_of(float t, float e) {  // t^e for t >= 0
  if constexpr (K == 0) {
    return t;
  } else if constexpr (K == 1) {
    return t * t;
  } else {
    const float pos = t > 0.f ? 1.f : 0.f;
    return pos * fast_exp2(e * fast_log2(t > 0.f ? t : 1.f));
  }
}

template <int K>
void sparse_row(float* y, int64_t n, float e, float* tau_io, float lo, float hi, int steps,
                float* total, float* cy, int32_t* ci) {
  constexpr float tiny = 1.17549435e-38f;
  int64_t m = 0, j0 = 0;
#if defined(__AVX512F__)
  // AVX-512: a block of 16 keys compressed in registers (cy and ci have 16 entries of slack)
  const __m512 lo16 = _mm512_set1_ps(lo);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (; j0 + 16 <= n; j0 += 16, at = _mm512_add_epi32(at, sixteen)) {
    const __m512 x = _mm512_loadu_ps(y + j0);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo16, _CMP_GT_OQ);
    if (keep == 0) continue;
    _mm512_storeu_ps(cy + m, _mm512_maskz_compress_ps(keep, x));
    _mm512_storeu_si512(ci + m, _mm512_maskz_compress_epi32(keep, at));
    m += __builtin_popcount(static_cast<unsigned>(keep));
  }
#endif
  for (; j0 < n; j0 += 16) {
    const int64_t len = std::min<int64_t>(16, n - j0);
    if (row_max(y + j0, len, kUnseen) <= lo) continue;
    for (int64_t q = 0; q < len; ++q) {  // branch-free: write, advance where y > lo
      cy[m] = y[j0 + q];
      ci[m] = static_cast<int32_t>(j0 + q);
      m += y[j0 + q] > lo ? 1 : 0;
    }
  }
  float tau = *tau_io;
  for (int it = 0; it < steps; ++it) {
    float f, slope;
    if constexpr (K == 0) {
      float sum = 0.f, count = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float t = std::max(cy[j] - tau, 0.f);
        sum += t;
        count += static_cast<float>(t > 0.f);
      }
      f = sum - 1.f;
      slope = count;
    } else if constexpr (K == 1) {
      float s1 = 0.f, s2 = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float t = std::max(cy[j] - tau, 0.f);
        s1 += t;
        s2 += t * t;
      }
      const float norm = std::sqrt(s2);
      f = norm - 1.f;
      slope = s1 * norm / std::max(s2, tiny);
    } else {
      float s0 = 0.f, s1 = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float t = std::max(cy[j] - tau, 0.f);
        const float p = weight_of<2>(t, e);
        s0 += p;
        s1 += p / (t > 0.f ? t : 1.f);  // t^{e−1} (p = 0 where t = 0)
      }
      const float norm = std::pow(s0, 1.f / e);
      f = norm - 1.f;
      slope = norm / std::max(s0, tiny) * s1;
    }
    const bool right = f < 0.f;
    if (right) {
      hi = tau;
    } else {
      lo = tau;
    }
    const float step = tau + f / std::max(slope, tiny);
    const float far = right ? lo : hi;
    const bool inside = step >= lo && step <= hi && (step != far || far == tau);
    tau = inside ? step : 0.5f * (lo + hi);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < m; ++j) {
    const float p = weight_of<K>(std::max(cy[j] - tau, 0.f), e);
    sum += p;
    cy[j] = p;
  }
  zero(y, n);
  for (int64_t j = 0; j < m; ++j) y[ci[j]] = cy[j];
  *tau_io = tau;
  *total = sum;
}

}  // namespace

namespace {

template <int Kind>
void sparse_solve(float e, float* y, int64_t rows, int64_t cols, float* tau, const float* lo,
                  const float* hi, int steps, float* total, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> cy(static_cast<size_t>(cols) + 16);  // 16 of slack: see sparse_row
    std::vector<int32_t> ci(static_cast<size_t>(cols) + 16);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      sparse_row<Kind>(y + r * cols, cols, e, tau + r, lo[r], hi[r], steps, total + r, cy.data(),
                       ci.data());
    }
  }
}

}  // namespace

// The threshold's loops by the Newton step they take: `sparse_solve_NAME` (attention/cpu/
// sparse_tiled.py names the step of its α: sparsemax, entmax15, or entmax for any other).
#define SPARSE_SOLVE(NAME, KIND)                                                                  \
  extern "C" void sparse_solve_##NAME(float e, float* y, int64_t rows, int64_t cols, float* tau, \
                                      const float* lo, const float* hi, int steps, float* total, \
                                      int threads) {                                             \
    sparse_solve<KIND>(e, y, rows, cols, tau, lo, hi, steps, total, threads);                    \
  }

SPARSE_SOLVE(sparsemax, 0)
SPARSE_SOLVE(entmax15, 1)
SPARSE_SOLVE(entmax, 2)

extern "C" {

// The entmax family's slab before its threshold (attention/cpu/sparse_tiled.py,
// _EntmaxAttention.forward): per row, m = the largest visible score (0 on a row that sees no
// key, live 0 there, else 1), y = max((s − m)·coef, floor) written over s (floor on keys past
// the row's causal end), and the largest y of each of `chunks` runs of `width` consecutive keys
// (the last run takes the rest) into cand (rows × chunks, unsorted).
void sparse_prepare(float* s, int64_t rows, int64_t cols, const int32_t* ends, int64_t tile_rows,
                    const float* coef, float floor_, float* m, float* live, float* cand,
                    int64_t chunks, int64_t width, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    const int64_t n = visible(ends, tile_rows, r, cols);
    const bool any = n > 0;
    const float mr = any ? row_max(x, n, kUnseen) : 0.f;
    const float c = coef[r];
    for (int64_t j = 0; j < n; ++j) x[j] = std::max((x[j] - mr) * c, floor_);
    for (int64_t j = n; j < cols; ++j) x[j] = floor_;
    float* cr = cand + r * chunks;
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t j0 = k * width, j1 = k + 1 == chunks ? cols : j0 + width;
      cr[k] = row_max(x + j0, j1 - j0, floor_);
    }
    m[r] = mr;
    live[r] = any ? 1.f : 0.f;
  }
}

}  // extern "C"

namespace {

constexpr float kLn2 = 0.6931471805599453f;

// log(1 + y) for 0 <= y <= 1: the series to y^7 below 1/16 (truncation below 2^-24 relative;
// 1 + y would round there and lose y's low bits, which a sum of many log σ(−s) keeps), the
// logarithm of 1 + y beyond.
inline float log1p_unit(float y) {
  float p = 1.f / 7.f;
  p = p * y - 1.f / 6.f;
  p = p * y + 1.f / 5.f;
  p = p * y - 1.f / 4.f;
  p = p * y + 1.f / 3.f;
  p = p * y - 0.5f;
  p = p * y + 1.f;
  const float log_u = fast_log2(1.f + y) * kLn2;
  return y < 0.0625f ? p * y : log_u;  // both computed: a select, which vectorises
}

// log σ(x) = min(x, 0) − log(1 + e^{−|x|}) for finite x.
inline float log_sigmoid(float x) { return std::min(x, 0.f) - log1p_unit(fast_exp(-std::fabs(x))); }

// Exclusive running sum in place from `start`: x_j becomes start + Σ_{k<j} x_k; returns the sum
// of all (the next tile's start). In the order the PyTorch path's cumsum adds.
inline float scan_exclusive(float* x, int64_t n, float start) {
  float run = start;
  for (int64_t j = 0; j < n; ++j) {
    const float t = x[j];
    x[j] = run;
    run += t;
  }
  return run;
}

// The shared first sweeps of stick-breaking's forward and backward on a row's n visible keys y
// (keys reversed): lp_j = log σ(y_j), then y_j = carry + Σ_{k<j} log σ(−y_k); returns the carry
// for the next tile.
inline float stick_log_weights(float* y, int64_t n, float* lp, float carry) {
  for (int64_t j = 0; j < n; ++j) {
    const float l = log_sigmoid(y[j]);
    lp[j] = l;
    y[j] = l - y[j];  // log σ(−s) = log σ(s) − s
  }
  return scan_exclusive(y, n, carry);
}

}  // namespace

extern "C" {

// w_j = exp(lp_j + y_j), written over y (lp: log σ(s), y: the stick's running log sum); with
// `ent` not null, −Σ w·log w and Σ w are added to *ent and *mass.
inline void stick_weights(float* y, const float* lp, int64_t n, float* ent, float* mass) {
  if (ent == nullptr) {
    for (int64_t j = 0; j < n; ++j) y[j] = fast_exp(lp[j] + y[j]);
    return;
  }
  float e = 0.f, total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float lw = lp[j] + y[j];
    const float w = fast_exp(lw);
    e -= w * lw;
    total += w;
    y[j] = w;
  }
  *ent += e;
  *mass += total;
}

// Stick-breaking (attention/cpu/stick_tiled.py, _log_weights), forward on one tile whose keys are
// reversed (nearest first): per row, carry = Σ log σ(−s) of the allowed keys to the right (read
// and written), log w_j = log σ(s_j) + carry + Σ_{k<j} log σ(−s_k), w written over s; with
// stats (ent and mass not null) ent −= Σ w·log w and mass += Σ w. `ends` counts the keys each
// row sees in the tile's own order: in the reversed tile the last ends[r], the others hidden
// (w = 0, the carry passes them).
void stick_forward(float* s, int64_t rows, int64_t cols, const int32_t* ends, int64_t tile_rows,
                   float* carry, float* ent, float* mass, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> lp(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* x = s + r * cols;
      const int64_t n = visible(ends, tile_rows, r, cols);
      zero(x, cols - n);
      float* y = x + (cols - n);
      carry[r] = stick_log_weights(y, n, lp.data(), carry[r]);
      stick_weights(y, lp.data(), n, ent ? ent + r : nullptr, ent ? mass + r : nullptr);
    }
  }
}

// Its backward on one tile (keys reversed as above): with gv = dO·vᵀ, per row the carry (as the
// forward), later = Σ w·g of the keys to the right (read and written) and D = Σ_j w_j·g_j over
// the whole row, s becomes dL/ds = w·g − σ(s)·(D − later − Σ_{k<j} w_k·g_k) and w the tile's
// weights. D and later are doubles, sums of the very float products w·g taken here (the caller's
// first walk gives D): at the far keys D − later is tiny, and in float it would keep the sums'
// rounding, which every far key's σ(s) takes again.
void stick_backward(float* s, const float* gv, float* w, int64_t rows, int64_t cols,
                    const int32_t* ends, int64_t tile_rows, float* carry, double* later,
                    const double* dd, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> lp(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* x = s + r * cols;
      float* wr = w + r * cols;
      const int64_t h = cols - visible(ends, tile_rows, r, cols), n = cols - h;
      zero(x, h);
      zero(wr, h);
      float* y = x + h;
      float* wy = wr + h;
      const float* g = gv + r * cols + h;
      carry[r] = stick_log_weights(y, n, lp.data(), carry[r]);
      for (int64_t j = 0; j < n; ++j) {
        const float wj = fast_exp(lp[j] + y[j]);
        wy[j] = wj;
        y[j] = wj * g[j];
        lp[j] = fast_exp(lp[j]);  // σ(s)
      }
      const double d = dd[r];
      double acc = later[r];
      for (int64_t j = 0; j < n; ++j) {
        const float t = y[j];
        y[j] = t - lp[j] * static_cast<float>(d - acc);
        acc += t;
      }
      later[r] = acc;
    }
  }
}

// Stick-breaking on whole rows in key order (attention/cpu/stick_tiled.py, the decoding path: a
// few query rows over every key they see, keys not reversed): row r sees its first ends[r mod
// tile_rows] keys (all with `ends` null), the others get w = 0. log w_j = log σ(s_j) +
// Σ_{k>j} log σ(−s_k), the sum added nearest key first (the order of `stick_forward` on the
// reversed keys): log σ in one vectorised sweep, the sum in one sweep back from the row's last
// visible key, exp in one more; w written over s; with stats (ent and mass not null) ent =
// −Σ w·log w and mass = Σ w are written.
void stick_forward_rows(float* s, int64_t rows, int64_t cols, const int32_t* ends,
                        int64_t tile_rows, float* ent, float* mass, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> lp(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* x = s + r * cols;
      const int64_t n = visible(ends, tile_rows, r, cols);
      zero(x + n, cols - n);
      float* l = lp.data();
      for (int64_t j = 0; j < n; ++j) {
        const float v = log_sigmoid(x[j]);
        l[j] = v;
        x[j] = v - x[j];  // log σ(−s) = log σ(s) − s
      }
      float run = 0.f;
      for (int64_t j = n - 1; j >= 0; --j) {
        const float t = x[j];
        x[j] = run;
        run += t;
      }
      if (ent != nullptr) ent[r] = mass[r] = 0.f;
      stick_weights(x, l, n, ent ? ent + r : nullptr, ent ? mass + r : nullptr);
    }
  }
}

// Its backward (same rows, keys in order): with gv = dO·vᵀ, s becomes dL/ds_j = w_j·g_j −
// σ(s_j)·A_j, A_j = Σ_{k<=j} w_k·g_k summed from the row's first key, and w the weights. (The
// tiles take A_j = D − Σ_{k>j} w_k·g_k with D = dO·out, since they walk the keys nearest first;
// at the far keys, where A_j is small, that keeps D's rounding, which every far key's σ(s_j)
// takes again: dq's error grew as the row's length.)
void stick_backward_rows(float* s, const float* gv, float* w, int64_t rows, int64_t cols,
                         const int32_t* ends, int64_t tile_rows, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> lp(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* x = s + r * cols;
      float* wr = w + r * cols;
      const float* g = gv + r * cols;
      const int64_t n = visible(ends, tile_rows, r, cols);
      zero(x + n, cols - n);
      zero(wr + n, cols - n);
      float* l = lp.data();
      for (int64_t j = 0; j < n; ++j) {
        const float v = log_sigmoid(x[j]);
        l[j] = v;
        x[j] = v - x[j];
      }
      float run = 0.f;
      for (int64_t j = n - 1; j >= 0; --j) {
        const float t = x[j];
        x[j] = run;
        run += t;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float wj = fast_exp(l[j] + x[j]);
        wr[j] = wj;
        x[j] = wj * g[j];
        l[j] = fast_exp(l[j]);  // σ(s)
      }
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float t = x[j];
        acc += t;
        x[j] = t - l[j] * acc;
      }
    }
  }
}

}  // extern "C"

namespace {

// Puts (x, j) into the descending list (val, idx) of `count` entries (capacity k), after every
// entry >= x (ties keep key order: j is later than every index there); the last entry drops out
// when the list is full. Returns the new count.
inline int64_t insert(float* val, int64_t* idx, int64_t count, int64_t k, float x, int64_t j) {
  int64_t pos = count < k ? count : k - 1;
  while (pos > 0 && val[pos - 1] < x) {
    val[pos] = val[pos - 1];
    idx[pos] = idx[pos - 1];
    --pos;
  }
  val[pos] = x;
  idx[pos] = j;
  return count < k ? count + 1 : k;
}

}  // namespace

extern "C" {

// Top-k's selection (attention/cpu/sparse_tiled.py, _TopkAttention) on a slab of rows: per row the
// k largest of its visible keys (the first ends[r mod tile_rows], or all) in descending order,
// ties broken by key order (the lower index kept), as values into val and key indices into idx
// (rows × k), and how many it found into filled (min(k, visible keys)); the slots past those
// get value 0 and index 0. One sweep per row: the maximum of each block of 64 keys is compared
// with the k-th largest so far (vectorised), and only a block with a larger key is inserted
// key by key.
void topk_select(const float* s, int64_t rows, int64_t cols, const int32_t* ends,
                 int64_t tile_rows, int64_t k, float* val, int64_t* idx, int64_t* filled,
                 int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = s + r * cols;
    const int64_t n = visible(ends, tile_rows, r, cols);
    float* v = val + r * k;
    int64_t* ix = idx + r * k;
    int64_t count = 0;
    int64_t j = 0;
    for (; j < n && count < k; ++j) count = insert(v, ix, count, k, x[j], j);
    float kth = v[k - 1];
    for (; j < n; j += 64) {
      const int64_t len = std::min<int64_t>(64, n - j);
      if (row_max(x + j, len, kUnseen) <= kth) continue;
      for (int64_t q = 0; q < len; ++q) {
        if (x[j + q] > kth) {
          insert(v, ix, k, k, x[j + q], j + q);
          kth = v[k - 1];
        }
      }
    }
    for (int64_t q = count; q < k; ++q) {
      v[q] = 0.f;
      ix[q] = 0;
    }
    filled[r] = count;
  }
}

}  // extern "C"
