/* Math helpers for generated CPU kernels (C++, included, never pasted).
 *
 * libm entry points that glibc's libmvec provides as vector variants are redeclared with
 * `simd("notinbranch")`, so gcc vectorizes `#pragma omp simd` loops calling them without
 * -ffast-math (libmvec is accurate to a few ULP; see DESIGN.md, "Vector math on CPU").
 * Semantics of the helpers follow ATen's CPU kernels (c10/util/math_compat.h,
 * aten/src/ATen/native/cpu/BinaryOpsKernel.cpp).
 */
#ifndef ACCEL_CPU_MATH_H
#define ACCEL_CPU_MATH_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <limits>
#include <type_traits>
#include "accel/kernel.h"
#include "accel/half.h"
#include "accel/libm_names.h"
#include "accel/vector_fmod.h" /* accel::fmod */
#if defined(__AVX__)
#include <immintrin.h> /* accel::transpose_tile's vector transposes */
#endif

namespace accel {
/* Each OpenMP thread's partial results of a column reduction whose rows are split among the
 * threads (accel/codegen/columns.py, ColumnLoops._emit_rows): n values a thread, for as
 * many threads as the parallel region may have. */
template <class T>
struct Partials {
  T* p;
  explicit Partials(int64_t n) : p(static_cast<T*>(malloc(sizeof(T) * n * omp_get_max_threads()))) {}
  ~Partials() { free(p); }
  Partials(const Partials&) = delete;
  Partials& operator=(const Partials&) = delete;
};
/* A transposing nest's tile (accel/codegen/tiles.py, TiledLoops._emit_transposed_tile):
 * dst[c * T + r] = src[c + r * sv] for c < un, r < vn. 4-byte values go through vector
 * registers: 16 x 16 blocks with AVX-512 (sixteen 16-wide loads, each a whole cache line, the
 * unpack / shuffle transpose of Inductor's transpose_mxn, from FBGEMM), else 8 x 8 with AVX
 * (the unpack / shuffle / lane-permute transpose), a partial tile's too (a channels-last group
 * norm's 8 channels a group); the edges past a multiple of 8 element by element. A tile's
 * blocks go along its rows first: the lines a block reads part of are read whole by the next
 * (a source row's lines, a power of two apart, share one cache set). */
#if defined(__AVX512F__)
inline void transpose_16x16(const float* s, int64_t sv, float* d, int64_t T) {
  __m512 in[16], t[16];
  for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_ps(s + i * sv);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
    in[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    in[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    in[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    in[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(in[8 * i + k], in[8 * i + k + 4], 0x88);
      t[8 * i + k + 4] = _mm512_shuffle_f32x4(in[8 * i + k], in[8 * i + k + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(d + i * T, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
    _mm512_storeu_ps(d + (i + 8) * T, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
  }
}
#endif
#if defined(__AVX__)
inline void transpose_8x8(const float* s, int64_t sv, float* d, int64_t T) {
  __m256 r[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(s + k * sv);
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(d + 0 * T, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(d + 1 * T, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(d + 2 * T, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(d + 3 * T, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(d + 4 * T, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(d + 5 * T, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(d + 6 * T, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(d + 7 * T, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif
template <int T, class E>
inline void transpose_tile(const E* __restrict__ src, int64_t sv, E* __restrict__ dst, int64_t un, int64_t vn) {
#if defined(__AVX__)
  if (sizeof(E) == 4 && T % 8 == 0) {
    const float* s = reinterpret_cast<const float*>(src);
    float* d = reinterpret_cast<float*>(dst);
    int64_t u16 = 0, v16 = 0;  // the part done in 16 x 16 blocks
#if defined(__AVX512F__)
    if (T % 16 == 0) {
      u16 = un & ~int64_t(15), v16 = vn & ~int64_t(15);
      for (int64_t b = 0; b < v16; b += 16)
        for (int64_t a = 0; a < u16; a += 16) transpose_16x16(s + a + b * sv, sv, d + a * T + b, T);
    }
#endif
    const int64_t ua = un & ~int64_t(7), va = vn & ~int64_t(7);
    for (int64_t b = 0; b < va; b += 8)
      for (int64_t a = b < v16 ? u16 : 0; a < ua; a += 8) transpose_8x8(s + a + b * sv, sv, d + a * T + b, T);
    for (int64_t r = 0; r < vn; ++r)  // the edges: columns past ua, rows past va
      for (int64_t c = r < va ? ua : 0; c < un; ++c) dst[c * T + r] = src[c + r * sv];
    return;
  }
#endif
  for (int64_t r = 0; r < vn; ++r)
    for (int64_t c = 0; c < un; ++c) dst[c * T + r] = src[c + r * sv];
}
/* n, hidden from the optimizer: a loop over a constant number of columns is then not
 * unrolled whole (the row split's blocks: 64 float64 column moments 0.95 -> 0.65 ms). */
inline int64_t opaque(int64_t n) {
  asm("" : "+r"(n));
  return n;
}
}  // namespace accel

#define ACCEL_VEC(ret, name, ...) ret name(__VA_ARGS__) noexcept __attribute__((simd("notinbranch")));
extern "C" {
#if defined(__x86_64__)
ACCEL_VEC(float, expf, float) ACCEL_VEC(float, exp2f, float) ACCEL_VEC(float, expm1f, float)
ACCEL_VEC(float, logf, float) ACCEL_VEC(float, log2f, float) ACCEL_VEC(float, log10f, float)
ACCEL_VEC(float, log1pf, float) ACCEL_VEC(float, sinf, float) ACCEL_VEC(float, cosf, float)
ACCEL_VEC(float, tanf, float) ACCEL_VEC(float, asinf, float) ACCEL_VEC(float, acosf, float)
ACCEL_VEC(float, atanf, float) ACCEL_VEC(float, sinhf, float) ACCEL_VEC(float, coshf, float)
ACCEL_VEC(float, tanhf, float) ACCEL_VEC(float, asinhf, float) ACCEL_VEC(float, acoshf, float)
ACCEL_VEC(float, atanhf, float) ACCEL_VEC(float, erff, float) ACCEL_VEC(float, erfcf, float)
ACCEL_VEC(float, cbrtf, float) ACCEL_VEC(float, powf, float, float)
ACCEL_VEC(float, atan2f, float, float)
ACCEL_VEC(double, exp, double) ACCEL_VEC(double, exp2, double) ACCEL_VEC(double, expm1, double)
ACCEL_VEC(double, log, double) ACCEL_VEC(double, log2, double) ACCEL_VEC(double, log10, double)
ACCEL_VEC(double, log1p, double) ACCEL_VEC(double, sin, double) ACCEL_VEC(double, cos, double)
ACCEL_VEC(double, tan, double) ACCEL_VEC(double, asin, double) ACCEL_VEC(double, acos, double)
ACCEL_VEC(double, atan, double) ACCEL_VEC(double, sinh, double) ACCEL_VEC(double, cosh, double)
ACCEL_VEC(double, tanh, double) ACCEL_VEC(double, asinh, double) ACCEL_VEC(double, acosh, double)
ACCEL_VEC(double, atanh, double) ACCEL_VEC(double, erf, double) ACCEL_VEC(double, erfc, double)
ACCEL_VEC(double, cbrt, double) ACCEL_VEC(double, pow, double, double)
ACCEL_VEC(double, atan2, double, double)
#endif
/* cos under another name (the same symbol, vector variants and all), for a kernel that
 * also takes the sin of the value (codegen.cpp.CppRenderer.op): gcc joins a builtin sin and
 * cos of one value into one call of glibc's scalar sincos, which it does not vectorize
 * (sin(x) * 2 + cos(x) on [8192, 1024] float32 ran scalar: 36.5 ms, eager's 9.5). Not for
 * every cos: gcc if-converts and vectorizes a builtin one under a select, not this one.
 * const: with -fno-math-errno, what gcc assumes of the builtin. */
float accel_libm_cosf(float) noexcept __asm__("cosf") __attribute__((simd("notinbranch"), const));
double accel_libm_cos(double) noexcept __asm__("cos") __attribute__((simd("notinbranch"), const));
}

namespace accel {
static inline float cos_apart(float x) { return ::accel_libm_cosf(x); }
static inline double cos_apart(double x) { return ::accel_libm_cos(x); }

#define ACCEL_UNARY(name, f32)                                        \
  static inline float name(float x) { return ::f32(x); }              \
  static inline double name(double x) { return ::name(x); }
ACCEL_LIBM_UNARY(ACCEL_UNARY)
#undef ACCEL_UNARY

/* lgamma and digamma below: float32 and float64 both computed in float64, every branch a
 * select (gcc vectorizes a loop calling them, with libmvec's log), inlined whatever their
 * size (a call would keep the loop scalar). */
#define ACCEL_SPECIAL __attribute__((always_inline)) static inline
/* c0 + x (c1 + x (c2 + ...)): Horner's rule, fused multiply-adds where the CPU has them */
ACCEL_SPECIAL double horner(double, double c) { return c; }
template <class... C>
ACCEL_SPECIAL double horner(double x, double c, C... rest) {
#if defined(__FMA__)
  return __builtin_fma(horner(x, rest...), x, c);
#else
  return horner(x, rest...) * x + c;
#endif
}
/* sin(pi r) and cos(pi r) for |r| <= 1/2, by their Taylor series (eleven and twelve terms:
 * truncation below 1.3e-18 and 1e-19) */
ACCEL_SPECIAL double sinpi_reduced(double r) {
  return r * horner(r * r, 3.141592653589793, -5.16771278004997, 2.5501640398773455, -0.5992645293207921,
                    0.08214588661112823, -0.0073704309457143504, 0.00046630280576761255, -2.1915353447830217e-05,
                    7.952054001475513e-07, -2.2948428997269873e-08, 5.392664662608129e-10);
}
ACCEL_SPECIAL double cospi_reduced(double r) {
  return horner(r * r, 1.0, -4.934802200544679, 4.0587121264167685, -1.3352627688545895, 0.2353306303588932,
                -0.02580689139001406, 0.0019295743094039231, -0.0001046381049248457, 4.303069587032947e-06,
                -1.3878952462213771e-07, 3.604730797462501e-09, -7.700707130601354e-11);
}
/* lgamma (log |Gamma(x)|), vectorizable, float32 and float64 both computed in float64.
 * glibc's lgammaf and lgamma have no libmvec variants: a loop calling them stayed scalar,
 * 35-40 ns a value, 3x eager's SLEEF vectors (Sleef_lgammaf16_u10). Lanczos's approximation
 * (C. Lanczos, "A Precision Approximation of the Gamma Function", SIAM J. Numer. Anal. B 1,
 * 1964), g = 7 with the nine coefficients of Numerical Recipes / Godfrey, as one rational
 * function: for y >= 0.5, Gamma(y) = sqrt(2 pi) t^(y - 1/2) e^-t P(y) / Q(y), t = y + 6.5,
 * Q(y) = y (y + 1) ... (y + 7) (the partial fractions p0 + sum_i p_i / (y + i - 1) summed
 * exactly, then rounded: every coefficient of P is positive, no cancellation), so
 *   lgamma(y) = (y - 1/2)(log t - 1) - 7 + log(2 pi) / 2 - log(Q / P)
 * (written so that (y - 1/2) log t does not overflow where the result does not). P / Q is
 * taken at min(y, 1e15): past it P / Q moves by under 3e-14, against a result above 3e16.
 * x < 0.5 by the reflection formula, Gamma(x) Gamma(1 - x) = pi / sin(pi x):
 *   lgamma(x) = -lgamma(1 - x) - log(|sin(pi r)| P(1 - x) / (pi Q(1 - x))),
 * r = x - rint(x) exact (sinpi_reduced); below |x| = 2^-52, -log|x| (the next term, -gamma x,
 * is under 2^-52 of it), through the same log. Poles (0, the negative integers) and +-inf:
 * inf; NaN: NaN; lgamma(1) = lgamma(2) = 0 exactly, as eager's; eager's early overflow
 * below. Every branch is a select (two logs, one division, no libm sin), so gcc vectorizes
 * a loop calling it, with libmvec's log: 3.8-4.5 ns a value (one thread of the dev VM's
 * AVX-512 Xeon), eager's SLEEF 6.5. Checked on all 2^32 float32 inputs against glibc's
 * float64 lgamma rounded to float32: within 1 ulp everywhere (16 differ; 19 built for
 * baseline x86-64), NaN and inf where it has them; float64 on 1.6e7 random bits and values
 * in [-100, 100]: relative error within 2.3e-12 where |lgamma| > 1e-3, absolute within
 * 3e-15 nearer lgamma's zeros (eager's own float32 is 1e5 ulp off near the negative ones). */
ACCEL_SPECIAL double lgamma_f64(double x) {
  const double pi = 3.14159265358979323846;
  const bool reflect = x < 0.5;
  const double y = reflect ? 1.0 - x : x;
  const double ya = y < 1e15 ? y : 1e15;
  const double p = horner(ya, 3409662.655334301, 4162387.8912255666, 2222880.4194936417, 678289.7015023341,
                          129347.25852873056, 15784.880456697452, 1203.8342013886463, 52.45833333334355,
                          0.9999999999998099);
  const double q = ya * horner(ya, 5040.0, 13068.0, 13132.0, 6769.0, 1960.0, 322.0, 28.0, 1.0);
  const double l0 = (y - 0.5) * (::log(y + 6.5) - 1.0) + (0.91893853320467274178 - 7.0);
  const double r = x - __builtin_rint(x);
  const double s = __builtin_fabs(sinpi_reduced(r));
  const bool tiny = __builtin_fabs(x) < 0x1p-52;
  const double num = reflect ? (tiny ? __builtin_fabs(x) * 0x1p64 : s * p) : q;
  const double den = reflect ? (tiny ? 1.0 : q * pi) : p;
  const double res = (tiny ? 64 * 0.69314718055994530942 : reflect ? -l0 : l0) - ::log(num / den);
  if ((reflect && r == 0.0) || __builtin_isinf(x)) return INFINITY;
  return (x == 1.0 || x == 2.0) ? 0.0 : res;
}
/* inf past the arguments where eager's SLEEF and the C library's lgammaf / lgamma both return
 * inf, a little before the true overflow (4.0372e36 float32 and 2.5563e305 float64, where
 * log Gamma(x) is 3.36e38 and 1.7951e308) */
ACCEL_SPECIAL float lgamma(float x) { return x > 0x1.84c272p+121f ? INFINITY : static_cast<float>(lgamma_f64(x)); }
ACCEL_SPECIAL double lgamma(double x) { return x > 0x1.74c5de97bb960p+1014 ? INFINITY : lgamma_f64(x); }
/* digamma (psi, the derivative of lgamma; what `torch.digamma` and lgamma's backward
 * compute), vectorizable: eager's CPU loop is scalar (ATen's calc_digamma, ATen/native/Math.h,
 * after Cephes' psi; its recurrence a loop of up to ten steps), about 25 ns a value; this
 * one 3-3.6 ns. The formulas of Abramowitz and Stegun, Handbook of Mathematical Functions
 * (1964), as calc_digamma's, without the loop:
 *   - psi(+-0) = -+inf, psi at a negative integer (and -inf) NaN;
 *   - x < 0, reflection (6.3.7): psi(x) = psi(1 - x) - pi / tan(p), p = pi r as eager rounds
 *     it (r = x - trunc(x), exact, times pi in float64; so within 1e-16 of eager's tan(p),
 *     which a float64 x within 1e-9 of a pole takes 2e-7 from the exact pi cot(pi x)):
 *     tan(p) = tan(pi u), u = x - rint(x) - (pi r - p) / pi (the product's rounding exact
 *     by a fused multiply-add, pi's own by its next 53 bits), sin(pi u) / cos(pi u) in
 *     sinpi_reduced and cospi_reduced;
 *   - recurrence (6.3.5) ten steps at once: psi(y) = psi(y + 10) - sum_{j<10} 1 / (y + j), the
 *     sum as (R(y) + y R'(y)) / (y R(y)), R(y) = (y + 1) ... (y + 9) (positive coefficients,
 *     no cancellation for y >= 0), taken at min(y, 1e30) (beyond, the sum is under 1e-29);
 *   - asymptotic series (6.3.18) at z = y + 10: psi(z) = ln z - 1 / (2z) - sum_k B_2k / (2k
 *     z^2k), seven terms (B_2k the Bernoulli numbers 1/6, -1/30, 1/42, -1/30, 5/66, -691/2730,
 *     7/6), truncation below 5e-17.
 * Checked on all 2^32 float32 inputs: within 1 ulp of eager's method computed in float64,
 * rounded (10 differ), and within the default tolerances of eager's float32 everywhere, NaN
 * and inf where it has them; float64 on 1.6e7 random bits, values in [-100, 100], within 1e-6
 * of the poles and of every exponent: within them of eager's everywhere (relative 4e-12
 * where |psi| > 1e-3). */
ACCEL_SPECIAL double digamma_f64(double x) {
  const double pi = 3.14159265358979323846;
  const bool reflect = x < 0.0;
  const double ro = x - __builtin_trunc(x), p = pi * ro;  // eager's r and its pi r, rounded
  const double u = (x - __builtin_rint(x)) - (__builtin_fma(pi, ro, -p) + 1.2246467991473532e-16 * ro) / pi;
  const double cot = reflect ? -pi * cospi_reduced(u) / sinpi_reduced(u) : 0.0;
  const double y = reflect ? 1.0 - x : x;
  const double ym = y < 1e30 ? y : 1e30;
  const double R = horner(ym, 362880.0, 1026576.0, 1172700.0, 723680.0, 269325.0, 63273.0, 9450.0, 870.0, 45.0, 1.0);
  const double dR = horner(ym, 1026576.0, 2345400.0, 2171040.0, 1077300.0, 316365.0, 56700.0, 6090.0, 360.0, 9.0);
  const double shift = (R + ym * dR) / (ym * R);
  const double z = y + 10.0, iz = 1.0 / z, z2 = iz * iz;
  const double series = z2 * horner(z2, 1.0 / 12, -1.0 / 120, 1.0 / 252, -1.0 / 240, 1.0 / 132, -691.0 / 32760, 1.0 / 12);
  const double res = cot + ((::log(z) - 0.5 * iz - series) - shift);
  if (x == 0.0) return __builtin_copysign(INFINITY, -x);
  return reflect && ro == 0.0 ? NAN : res;
}
ACCEL_SPECIAL float digamma(float x) { return static_cast<float>(digamma_f64(x)); }
ACCEL_SPECIAL double digamma(double x) { return digamma_f64(x); }
#undef ACCEL_SPECIAL

/* a * b + c in one rounding where the CPU has FMA (inside the polynomials below only:
 * generated arithmetic keeps eager's separate roundings, -ffp-contract=off) */
#if defined(__FMA__)
#define ACCEL_FMA(a, b, c) __builtin_fmaf(a, b, c)
#else
#define ACCEL_FMA(a, b, c) ((a) * (b) + (c))
#endif

/* expf, vectorizable over its whole range (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a
 * degree-6 polynomial in r, scaled by 2^n as two powers of two so that every n in
 * [-150, 144] stays in the exponent range). libmvec's expf takes a slow scalar path for
 * inputs whose result underflows or overflows (a masked softmax's -inf or finfo.min
 * logits), ten times slower; this one does not. In [-104, 100] the scaling overflows to
 * inf or rounds to eager's subnormal results and 0 by itself; below, the result is 0 and
 * above, inf, selected at the end, and a NaN passes the selects and the arithmetic (x
 * clamped to [-104, 100] first gives the same bits for every float, checked on all 2^32,
 * but gcc vectorizes the clamps as compares and blends around the whole computation: 1.3x
 * the time). Out of range, (int32_t)fx is the x86 conversion's INT_MIN, as for a NaN.
 * Within 1.01 ulp of the exact exp on every float in [-110, 100] (checked on every 7th;
 * mean 0.0045 ulp), as eager's (SLEEF's u10). */
static inline float exp_reduced(float x, float* fx) {  /* e^r, x = fx ln2 + r */
  *fx = __builtin_rintf(x * 1.44269504088896341f);  /* vectorizes; roundeven does not */
  float r = ACCEL_FMA(*fx, -0.693359375f, x);
  r = ACCEL_FMA(*fx, 2.12194440e-4f, r);
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = ACCEL_FMA(y, r, 1.3981999507e-3f);
  y = ACCEL_FMA(y, r, 8.3334519073e-3f);
  y = ACCEL_FMA(y, r, 4.1665795894e-2f);
  y = ACCEL_FMA(y, r, 1.6666665459e-1f);
  y = ACCEL_FMA(y, r, 5.0000001201e-1f);
  return ACCEL_FMA(y, z, r) + 1.0f;
}
static inline float exp(float x) {
  float fx;
  const float y = exp_reduced(x, &fx);
  const int32_t n = (int32_t)fx, h = n >> 1;
  const float p1 = __builtin_bit_cast(float, (h + 127) << 23);
  const float p2 = __builtin_bit_cast(float, (n - h + 127) << 23);
  const float e = (y * p1) * p2;
  const float e_hi = x > 100.0f ? float(INFINITY) : e;
  return x < -104.0f ? 0.0f : e_hi;
}
static inline double exp(double x) { return ::exp(x); }

/* exp(a) for erf's a = -x^2 <= 0 (or NaN): exp above with a clamped to -87 (a NaN stays
 * NaN), so that 2^n, n >= -126, is one normal power of two and no range select is left.
 * Below -87 exp's result (< 1.7e-38, against t P(t) < 1) no longer moves 1 - t P(t) exp(a)
 * off 1.0f, and for a >= -87 both forms round y 2^n once: vec_erf gives the same bits with
 * it on every float (checked on all 2^32), about 9 % faster. */
static inline float exp_erf(float a) {
  float fx;
  const float y = exp_reduced(a < -87.0f ? -87.0f : a, &fx);
  return y * __builtin_bit_cast(float, ((int32_t)fx + 127) << 23);
}

/* erf as ATen's Vectorized<float>::erf (aten/src/ATen/cpu/vec/vec512/vec512_float.h, the
 * same in vec256), the erf of torch.compile's CPU code and of ATen's vectorized GELU:
 * Abramowitz & Stegun 7.1.26, t = 1 / (1 + p|x|), erf(x) = sign(x) (1 - t P(t) exp(-x^2)),
 * absolute error < 1.5e-7 in exact arithmetic (3.6e-7 in float32), with ATen's operations,
 * FMAs and sign-bit flip. accel's GELU takes it (accel.decompositions._gelu, accel.library.vec_erf):
 * about half the time of libmvec's erff. Float64: erf (ATen's Vectorized<double>::erf is
 * SLEEF's accurate one). */
static inline float vec_erf(float x) {
  const float t = 1.0f / ACCEL_FMA(0.3275911f, __builtin_fabsf(x), 1.0f);
  float r = ACCEL_FMA(1.061405429f, t, -1.453152027f);
  r = ACCEL_FMA(r, t, 1.421413741f);
  r = ACCEL_FMA(r, t, -0.284496736f);
  r = ACCEL_FMA(r, t, 0.254829592f);
  const float y = ACCEL_FMA(-exp_erf(-(x * x)) * t, r, 1.0f);
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, y) ^
                                       (__builtin_bit_cast(uint32_t, x) & 0x80000000u));
}
static inline double vec_erf(double x) { return ::erf(x); }

/* log as the C library computes one value (glibc's scalar logf: eager's CPU xlogy_kernel
 * calls std::log in a scalar loop), which libmvec's vector logf may differ from in the last
 * bit (accel.library.log_libm). Out of the compiler's sight (noipa): no vector variant, so a
 * loop calling it stays scalar, and gcc does not swap in the vector logf. */
__attribute__((noipa)) static float log_libm(float x) { return ::logf(x); }
__attribute__((noipa)) static double log_libm(double x) { return ::log(x); }

#define ACCEL_BINARY(name, f32)                                                 \
  static inline float name(float a, float b) { return ::f32(a, b); }            \
  static inline double name(double a, double b) { return ::name(a, b); }
ACCEL_LIBM_BINARY(ACCEL_BINARY)
#undef ACCEL_BINARY
/* hypot correctly rounded, as eager's CPU kernel gives it (Sleef's, within 0.5001 ulp; its
 * float64 results equal Python's correctly rounded math.hypot): libm's (libmvec's in
 * vectorized loops) differed from eager's in 16 % of the elements, which a gradient through
 * a cancellation turned into differences of 15 %.
 * float: in double, where both squares are exact and the sum and the root are rounded once
 * each; only a double rounding to float can miss (about one in 2^29 results).
 * double: Borges's fma-corrected algorithm ("An Improved Algorithm for hypot(a, b)",
 * arXiv:1904.09481, 2019), the operands scaled by powers of two away from overflow and
 * underflow; a smaller operand under 2^-27 of the larger adds less than half an ulp.
 * hypot(+-inf, NaN) = inf (C99 F.10.4.3). */
static inline float hypot(float a, float b) {
  if (__builtin_isinf(a) || __builtin_isinf(b)) return INFINITY;
  const double x = a, y = b;
  return static_cast<float>(__builtin_sqrt(x * x + y * y));
}
static inline double hypot(double a, double b) {
  a = __builtin_fabs(a);
  b = __builtin_fabs(b);
  if (__builtin_isinf(a) || __builtin_isinf(b)) return INFINITY;
  if (a != a || b != b) return a + b;  // NaN
  if (a < b) {
    const double t = a;
    a = b;
    b = t;
  }
  if (b <= a * 0x1p-27) return a;  // (also b == 0)
  double scale = 1.0;
  if (a > 0x1p+500) {
    a *= 0x1p-600, b *= 0x1p-600, scale = 0x1p+600;
  } else if (a < 0x1p-450) {
    a *= 0x1p+600, b *= 0x1p+600, scale = 0x1p-600;
  }
  double h = __builtin_sqrt(__builtin_fma(a, a, b * b));
  const double h_sq = h * h, a_sq = a * a;
  const double x = __builtin_fma(-b, b, h_sq - a_sq) + __builtin_fma(h, h, -h_sq) - __builtin_fma(a, a, -a_sq);
  h -= x / (2 * h);
  return h * scale;
}
/* pow as pow defines it at an exponent of 0.5 (pow(-inf, 0.5) = inf, pow(-0.0, 0.5) = 0.0):
 * gcc 12 folds powf(x, 0.5f) with a constant exponent into sqrtf(x) (NaN and -0.0 there)
 * even without -funsafe-math-optimizations. Where accel means sqrt the passes say so
 * (passes.specialize_pow, as eager's fast path); an exponent left as 0.5 is eager's pow
 * (float16 on the CPU). */
static inline float pow(float a, float b) {
  return b == 0.5f ? (a == -INFINITY ? INFINITY : __builtin_sqrtf(a) + 0.0f) : ::powf(a, b);
}
static inline double pow(double a, double b) {
  return b == 0.5 ? (a == -INFINITY ? INFINITY : __builtin_sqrt(a) + 0.0) : ::pow(a, b);
}
/* a * b + c rounded once (accel.library.fma: ATen's vectorized lerp); an FMA instruction
 * where the CPU has one (-march=native), vectorized. */
static inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }
/* a * b rounded on its own (accel.library.mul_rn): any product here is (-ffp-contract=off) */
static inline float mul_rn(float a, float b) { return a * b; }
static inline double mul_rn(double a, double b) { return a * b; }
/* a / b, a true division (accel.library.div_rn) */
static inline float div_rn(float a, float b) { return a / b; }
static inline double div_rn(double a, double b) { return a / b; }

/* fmax/fmin as eager's CPU kernels (std::fmax and Vectorized's fmax, both loops): a NaN
 * operand gives the other, and where the two are zeros of either sign the first is
 * returned (libm's fmaxf returned the second). Selects: they vectorize. */
template <typename T> static inline T fmax(T a, T b) { return (a < b || a != a) ? b : a; }
template <typename T> static inline T fmin(T a, T b) { return (a > b || a != a) ? b : a; }

/* round half to even, as eager's (ATen's vector round: roundscale to nearest; its scalar
 * loop's std::nearbyint). rint rounds in the current rounding mode, which is to nearest
 * in every thread PyTorch starts; gcc 12 vectorizes no roundeven, so every loop with a
 * torch.round ran scalar (eighty-first round). */
static inline float round(float x) { return __builtin_rintf(x); }
static inline double round(double x) { return __builtin_rint(x); }

/* A float's or double's bits as an unsigned integer, and its sign bit there. */
template <typename T> constexpr bool ieee_v = std::is_same_v<T, float> || std::is_same_v<T, double>;
template <typename T> using bits_t = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
template <typename T> constexpr bits_t<T> sign_mask = bits_t<T>(1) << (8 * sizeof(T) - 1);
template <typename T> static inline bits_t<T> bits(T x) { return __builtin_bit_cast(bits_t<T>, x); }
/* abs, signbit and copysign read and write the sign bit as an integer. C leaves the sign of
 * a NaN an operation produces unspecified, and gcc folds them for a value it proves
 * non-negative, NaN or not (signbit(t / t) of t = float(b), b a bool, to false; fabs of it
 * to the value itself), where x86's 0 / 0 gives a NaN with its sign bit set, which eager's
 * kernels read (a random program's copysign(b1, b0 / b0): 1 against eager's -1). An integer
 * operation on the bits is not folded. */
template <typename T> static inline T abs(T x) {
  if constexpr (ieee_v<T>) return __builtin_bit_cast(T, bits(x) & ~sign_mask<T>);
  else return x < 0 ? T(-x) : x;
}
template <typename T> static inline bool signbit(T x) {
  if constexpr (ieee_v<T>) return (bits(x) & sign_mask<T>) != 0;
  else return x < 0;
}
template <typename T> static inline T copysign(T a, T b) {
  return __builtin_bit_cast(T, (bits(a) & ~sign_mask<T>) | (bits(b) & sign_mask<T>));
}
/* nextafter as glibc's: y where x == y, x + y where either is NaN (its NaN, as before), the
 * next float from x towards y otherwise (the smallest subnormal with y's sign from a zero),
 * all as selects and an integer step on the bits, which vectorize: glibc's nextafterf is
 * scalar (float32 [1024, 1024]: 8.1 ms, eager's SLEEF vectors 1.1). */
template <typename T> static inline T nextafter(T x, T y) {
  using B = bits_t<T>;
  const B step = ((x < y) == (x > T(0))) ? B(1) : B(-1);  /* magnitude up or down */
  const B moved = x == T(0) ? B(B(1) | (bits(y) & sign_mask<T>)) : B(bits(x) + step);
  const T r = __builtin_bit_cast(T, moved);
  return (x != x || y != y) ? x + y : (x == y ? y : r);
}
template <typename T> static inline bool isfinite(T x) {
  if constexpr (std::is_floating_point_v<T>) return x - x == x - x;
  else return true;
}
/* A floating value truncated to int32_t or int64_t as x86's conversion instructions give
 * it (cvttss2si, vcvttps2qq, ...: eager's conversion on x86 CPUs): NaN and values outside
 * the type's range give its minimum, the "integer indefinite" value. C++ leaves those
 * conversions undefined, and gcc turned a bfloat16 NaN, rounded from float32 and widened
 * again, into 0 where it was converted to int64_t. The select vectorizes. */
template <typename I, typename F> static inline I trunc_to(F x) {
  constexpr F lim = F(-(double)std::numeric_limits<I>::min());  /* 2^31 or 2^63, exact */
  return (x >= -lim && x < lim) ? static_cast<I>(x) : std::numeric_limits<I>::min();
}
#define ACCEL_FN static inline
#include "accel/scalar_ops.h"
#undef ACCEL_FN

}  // namespace accel

/* NaN-propagating max/min as OpenMP reductions (omp simd / parallel for). */
#pragma omp declare reduction(accel_max : float, double, int32_t, int64_t, bool : \
    omp_out = accel::maximum(omp_out, omp_in)) initializer(omp_priv = omp_orig)
#pragma omp declare reduction(accel_min : float, double, int32_t, int64_t, bool : \
    omp_out = accel::minimum(omp_out, omp_in)) initializer(omp_priv = omp_orig)

namespace accel {


/* Streaming (non-temporal) stores for outputs larger than the last-level cache: the block
 * ``src`` (N values, computed into an L1-resident array) goes to ``dst`` without the cache
 * first reading dst's lines (a plain store's read-for-ownership: a third of the traffic of
 * a kernel that reads one array and writes another), as glibc's memcpy does above its
 * non-temporal threshold. Unaligned head and tail bytes take plain stores. Every thread
 * that streamed calls stream_fence() before others may read what it wrote. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define ACCEL_STREAM_VEC 64
#elif defined(__x86_64__) && defined(__AVX__)
#define ACCEL_STREAM_VEC 32
#elif defined(__x86_64__) && defined(__SSE2__)
#define ACCEL_STREAM_VEC 16
#else
#define ACCEL_STREAM_VEC 0
#endif

/* Streaming stores write whole cache lines: a line streamed in part and stored plainly in
 * part (a head aligned to a 32-byte vector only, mid-line) took torch.diff's [8192, 1023]
 * rows 12.2 ms against 4.0 ms eager on a Zen 3 EPYC (bench/README.md, eighty-ninth round). */
#define ACCEL_STREAM_LINE 64  /* copy_small copies the partial lines: at most 64 */

/* one vector of ACCEL_STREAM_VEC bytes from s (any alignment) to d (aligned to it), through
 * the compiler's builtins: <immintrin.h> would add 0.4 s to every kernel's build */
static inline void stream_vec(char* d, const char* s) {
#if ACCEL_STREAM_VEC > 0
  typedef long long vec __attribute__((vector_size(ACCEL_STREAM_VEC)));
  vec v;
  memcpy(&v, s, sizeof v);
#if defined(__clang__)
  __builtin_nontemporal_store(v, (vec*)d);
#elif ACCEL_STREAM_VEC == 64
  __builtin_ia32_movntdq512((vec*)d, v);
#elif ACCEL_STREAM_VEC == 32
  __builtin_ia32_movntdq256((vec*)d, v);
#else
  __builtin_ia32_movntdq((vec*)d, v);
#endif
#else
  (void)d, (void)s;
#endif
}

/* n < 64 bytes from s to d by plain stores: two copies of the largest power of two not over n,
 * overlapping (glibc's memcpy for small sizes). gcc writes a memcpy of a variable size as
 * `rep movs`, whose start-up took a fifth of a row kernel's samples (rows starting mid-line)
 * on a Zen 3 EPYC (bench/README.md, ninety-first round). */
static inline void copy_small(char* __restrict__ d, const char* __restrict__ s, int64_t n) {
  if (n >= 32) {
    memcpy(d, s, 32), memcpy(d + n - 32, s + n - 32, 32);
  } else if (n >= 16) {
    memcpy(d, s, 16), memcpy(d + n - 16, s + n - 16, 16);
  } else if (n >= 8) {
    memcpy(d, s, 8), memcpy(d + n - 8, s + n - 8, 8);
  } else if (n >= 4) {
    memcpy(d, s, 4), memcpy(d + n - 4, s + n - 4, 4);
  } else if (n >= 2) {
    memcpy(d, s, 2), memcpy(d + n - 2, s + n - 2, 2);
  } else if (n == 1) {
    *d = *s;
  }
}

template <int N, typename T> static inline void stream_store(T* __restrict__ dst, const T* __restrict__ src) {
  char* d = (char*)dst;
  const char* s = (const char*)src;
  constexpr int64_t bytes = N * (int64_t)sizeof(T), V = ACCEL_STREAM_VEC, L = ACCEL_STREAM_LINE;
  int64_t i = 0;
  if (V > 0 && bytes % L == 0 && (uintptr_t)d % L == 0) {
#pragma GCC unroll 16
    for (; i < bytes; i += V) stream_vec(d + i, s + i);
    return;
  }
  if (V > 0) {  /* plain head up to the first whole cache line, whole lines streamed, plain tail */
    i = (L - (int64_t)((uintptr_t)d % L)) % L;
    if (i > bytes) i = bytes;
    copy_small(d, s, i);
    for (; i + L <= bytes; i += L)
      for (int64_t j = 0; j < L; j += V) stream_vec(d + i + j, s + i + j);
    copy_small(d + i, s + i, bytes - i);
    return;
  }
  memcpy(d, s, bytes);
}

/* Elements of T from p to the next cache line's start (0 where p starts one): a row's first
 * values stored plainly, so that its streamed blocks cover whole lines. A [8192, 1023]
 * float32 row kernel's blocks, each starting 4 bytes past the last, streamed three lines
 * of five and stored two plainly: 2.2-2.7 ms against 1.2-1.4 ms peeled on the Zen 3 VM
 * (bench/README.md, ninety-first round). */
template <typename T> static inline int64_t line_head(const T* p) {
  return (int64_t)((ACCEL_STREAM_LINE - (uintptr_t)p % ACCEL_STREAM_LINE) % ACCEL_STREAM_LINE / sizeof(T));
}

static inline void stream_fence() {
#if ACCEL_STREAM_VEC > 0
  __builtin_ia32_sfence();
#endif
}

/* Mean and sum of squared deviations in one pass: sums of the values' deviations from a
 * shift k, the first value (0 where it is not finite), and of their squares, in L lanes
 * (independent vector accumulators: one `omp simd reduction` chain waits on each add's
 * latency), blocks of values at a time; finish() gives mean = k + s / n and
 * m2 = q - s * s / n, as accel::ShiftedMoments on CUDA (Chan, Golub & LeVeque 1983,
 * "Algorithms for computing the sample variance": shifted data). The shift is one of the
 * values, so (k - mean)^2 <= m2 and the subtraction's relative error stays within about
 * n ulps of T (float32 values in double: far inside float32's). One pass instead of
 * blockwise Welford's two (each block's mean, then its squared deviations from it):
 * [256, 25088] float32 rows' moments on the 2-core dev VM 2.2 -> 1.3 ms. An infinite
 * value gives an infinite mean and a NaN m2, as eager's Welford does (an infinite first
 * value is not the shift: 0 is). */
template <typename T> struct ShiftedMoments {
  static constexpr int L = 16;
  T k = 0, n = 0, mean = 0, m2 = 0;
  T sl[L] = {0}, ql[L] = {0}, s0 = 0, q0 = 0;
  /* the mean, NaN over no values (0 / 0, as eager) */
  inline T mean_or_nan() const { return n > 0 ? mean : T(NAN); }
  inline void add(const T* x, int64_t m) {
    if (m <= 0) return;
    if (n == 0) k = std::isfinite(x[0]) ? x[0] : T(0);
    T a[L], b[L];
    for (int l = 0; l < L; ++l) { a[l] = sl[l]; b[l] = ql[l]; }
    const int64_t ml = m - m % L;
    for (int64_t i = 0; i < ml; i += L) {
#pragma omp simd
      for (int l = 0; l < L; ++l) { const T d = x[i + l] - k; a[l] += d; b[l] += d * d; }
    }
    for (int l = 0; l < L; ++l) { sl[l] = a[l]; ql[l] = b[l]; }
    for (int64_t i = ml; i < m; ++i) { const T d = x[i] - k; s0 += d; q0 += d * d; }
    n += T(m);
  }
  /* mean and m2 from the sums (after the last add) */
  inline void finish() {
    if (n <= 0) return;
    T s = s0, q = q0;
    for (int l = 0; l < L; ++l) { s += sl[l]; q += ql[l]; }
    const T d = s / n, r = q - s * d;
    mean = k + d;
    m2 = r > 0 ? r : T(0);
    if (r != r) m2 = r;  /* NaN (an infinite value) stays NaN */
  }
};

/* Running max m and sum s of exp(x - m) in one pass (Milakov & Gimelshein 2018, "Online
 * normalizer calculation for softmax"), blockwise: s is rescaled once per block. NaN
 * propagates; while every value seen is -inf, s stays 0 (eager's result is NaN there too). */
template <typename T> struct OnlineSoftmax {
  T m = -INFINITY, s = 0;
  inline void add(const T* x, int64_t k) {
    T bm = -INFINITY, bs = 0;
#pragma omp simd reduction(accel_max : bm)
    for (int64_t i = 0; i < k; ++i) bm = accel::maximum(bm, x[i]);
    const T nm = accel::maximum(m, bm);
    if (nm == -INFINITY) return;
#pragma omp simd reduction(+ : bs)
    for (int64_t i = 0; i < k; ++i) bs += accel::exp(x[i] - nm);
    s = s * accel::exp(m - nm) + bs;
    m = nm;
  }
};

}  // namespace accel
#endif /* ACCEL_CPU_MATH_H */
