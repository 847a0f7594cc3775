/* fmod for generated CPU kernels, vectorized and exact (C99 fmod: x - n y with n = trunc(x /
 * y), computed without rounding; every finite result is representable, so any correct
 * implementation gives these bits: eager's scalar loop's (std::fmod), Python's math.fmod).
 * glibc's fmodf and fmod are scalar and libmvec has no vector variants, so a loop calling
 * them stayed scalar: `torch.fmod`, `torch.remainder` and floating floor division (whose
 * c10 formula takes an fmod) of [1024, 1024] took 23-31 ms where eager's SLEEF vectors take
 * 1.7-3.6 (float32 and float64).
 *
 * `accel_fmodf` and `accel_fmod` are declared `omp declare simd` like half.h's F16C
 * conversions: their vector variants (the x86-64 vector function ABI's `_ZGVdN8vv_` /
 * `_ZGVdN4vv_` for AVX2, `_ZGVeN16vv_` / `_ZGVeN8vv_` and the AVX2 widths' `_ZGVe` names
 * for AVX-512) are written with gcc's vector extensions in vector_fmod_variants.h, which a
 * kernel that takes an fmod includes; the scalar entry points are glibc's, defined there
 * where the compiler does not see them (a definition it saw would make it build its own
 * vector variants from the scalar body).
 *
 * The algorithm, in float64 lanes (float32 values widened exactly; their subnormals are
 * float64 normals): r = |x| reduced by s = |y| 2^e, e = max(0, exponent(r) - exponent(|y|)
 * - 29), until r < |y|; fmod(r, s) mod |y| is fmod(r, |y|), since s is a multiple of |y|.
 * Each step's quotient r / s is below 2^30, so its rounded float64 value, truncated, is
 * the exact quotient n or n +- 1; of t1 = r - (q + 1) s and t0 = r - q s (fused
 * multiply-adds) the remainder is t1 if t1 >= 0, else t0 if t0 >= 0, else t0 + s, each
 * exact (every value in (-s, s) on s's grid is representable; an inexact candidate, in [s,
 * 2s) or below -s, is never the one taken). One step for |x / y| < 2^30, up to 70 for
 * float64's widest ratios. Where every lane of a vector has |x| < 2^22 |y| (float32; 2^30
 * float64), that one step runs in the type's own arithmetic, without the loop (float32:
 * its 16 lanes a register, 1.7 -> 0.8 ns a value); an infinite y takes the loop. Lanes
 * holding a NaN, an infinite x, a zero or float64-subnormal y take the C library's fmodf
 * / fmod, as before (their NaN bits included).
 * Checked against glibc on 1.6e8 float32 and 8e7 float64 pairs (random bits; exponents
 * close together and up to 2^120 apart; divisors near and under the subnormal range;
 * small integers and quarters; special values among ordinary lanes): all the same bits.
 *
 * `accel_div_floorf` and `accel_div_floor` (accel.library.div_floor: floating floor
 * division, c10::div_floor_floating's bits) are declared and defined alike. c10's formula
 * takes an fmod and two divisions; where every lane of a vector has b finite and not
 * zero and |q| < 2^22 (float32; 2^30 float64), q = a / b rounded, its result is the exact
 * floor of a / b (mod is exact, (a - mod) / b is within a few ulps of the integer n it
 * stands for, and floor-then-round-past-a-half gives n), with the sign of q where that is
 * 0. There the variants take f = floor(q), which is that floor or one more (q rounded up
 * to an integer), and less 1 where r = fma(-f, b, a), a - f b rounded once (its sign
 * exact), differs in sign from b: one division ([8192, 1024] float32, 7.45 -> 3.40 ms on the
 * 2-core Zen 3 VM; bench/README.md, ninety-first round). Other vectors take c10's formula
 * lane by lane. */
#ifndef ACCEL_VECTOR_FMOD_H
#define ACCEL_VECTOR_FMOD_H
#include <math.h>

#if !defined(__CUDACC__) && defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define ACCEL_VECTOR_FMOD 1
/* the `omp declare simd` variants of a float and a double function: AVX2's widths, and
 * AVX-512's too where it is on */
#ifdef __AVX512F__
#define ACCEL_SIMD_F32 _Pragma("omp declare simd simdlen(8) notinbranch") _Pragma("omp declare simd simdlen(16) notinbranch")
#define ACCEL_SIMD_F64 _Pragma("omp declare simd simdlen(4) notinbranch") _Pragma("omp declare simd simdlen(8) notinbranch")
#else
#define ACCEL_SIMD_F32 _Pragma("omp declare simd simdlen(8) notinbranch")
#define ACCEL_SIMD_F64 _Pragma("omp declare simd simdlen(4) notinbranch")
#endif
/* a binary float function f32 and its double twin f64, vectorized (vector_fmod_variants.h) */
#define ACCEL_DECLARE_VECTOR_PAIR(f32, f64)                                    \
  ACCEL_SIMD_F32 __attribute__((const, nothrow)) float f32(float a, float b); \
  ACCEL_SIMD_F64 __attribute__((const, nothrow)) double f64(double a, double b);
extern "C" {
ACCEL_DECLARE_VECTOR_PAIR(accel_fmodf, accel_fmod)
ACCEL_DECLARE_VECTOR_PAIR(accel_div_floorf, accel_div_floor)
}
#endif

namespace accel {
/* the C library's fmod (exact; scalar) */
static inline float c_fmod(float a, float b) { return ::fmodf(a, b); }
static inline double c_fmod(double a, double b) { return ::fmod(a, b); }

/* Floating floor division as c10::div_floor_floating computes it (eager's CPU and CUDA
 * kernels, and torch._refs' _floor_divide_float): mod = fmod(a, b) (exact), (a - mod) / b,
 * less 1 where mod and b differ in sign, floored and rounded up past a half; copysign(0,
 * a / b) where that is 0; a / b where b is 0. */
template <class T>
static inline T div_floor_c10(T a, T b) {
  if (b == 0) return a / b;
  const T mod = c_fmod(a, b);
  T div = (a - mod) / b;
  if (mod != 0 && (b < 0) != (mod < 0)) div -= T(1);
  if (div == 0) return __builtin_copysign(T(0), a / b);
  T fl = __builtin_floor(div);
  if (div - fl > T(0.5)) fl += T(1);
  return fl;
}
#ifdef ACCEL_VECTOR_FMOD
static inline float fmod(float a, float b) { return ::accel_fmodf(a, b); }
static inline double fmod(double a, double b) { return ::accel_fmod(a, b); }
/* (accel.library.div_floor) */
static inline float div_floor(float a, float b) { return ::accel_div_floorf(a, b); }
static inline double div_floor(double a, double b) { return ::accel_div_floor(a, b); }
#else
static inline float fmod(float a, float b) { return c_fmod(a, b); }
static inline double fmod(double a, double b) { return c_fmod(a, b); }
static inline float div_floor(float a, float b) { return div_floor_c10(a, b); }
static inline double div_floor(double a, double b) { return div_floor_c10(a, b); }
#endif
}  // namespace accel
#endif /* ACCEL_VECTOR_FMOD_H */
