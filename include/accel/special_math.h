/* Special functions both backends compute with the same code (included by cpu_math.h and
 * cuda_math.cuh inside namespace accel, after ACCEL_SPECIAL is defined: their qualifiers,
 * `static inline` or `__device__ __forceinline__`, and the libm wrappers `accel::log`,
 * `accel::tan` and `accel::trunc`, already declared).
 *
 * digamma (psi, the derivative of lgamma; what `torch.digamma` and lgamma's backward
 * compute), in the argument's precision, by the method of Cephes' psi and of ATen's
 * calc_digamma (ATen/native/Math.h), written from the formulas of Abramowitz and Stegun,
 * Handbook of Mathematical Functions (1964):
 *   - psi(+-0) = -+inf, psi at a negative integer NaN (a pole);
 *   - x < 0, reflection (6.3.7): psi(x) = psi(1 - x) - pi / tan(pi r), r the fractional
 *     part of x (taken apart first: tan(pi r) is exact where pi x is not), in double;
 *   - recurrence (6.3.5): psi(x) = psi(x + 1) - 1 / x, up to x >= 10; psi(10) exactly;
 *   - asymptotic series (6.3.18): psi(x) = ln x - 1 / (2x) - sum_k B_2k / (2k x^2k), seven
 *     terms (B_2k the Bernoulli numbers: 1/12, -1/120, 1/252, -1/240, 1/132, -691/32760,
 *     1/12 for k = 1..7).
 * Within a few ulp of eager's on both devices (eager's CUDA kernel is the same method).
 */
#ifndef ACCEL_SPECIAL_MATH_H
#define ACCEL_SPECIAL_MATH_H

template <typename T>
ACCEL_SPECIAL T digamma(T x) {
  const T psi_10 = T(2.25175258906672110764);  // psi(10) = H_9 - Euler's gamma
  if (x == T(0)) return T(1) / x > T(0) ? -T(INFINITY) : T(INFINITY);  // psi(-0.0) = +inf
  T result = T(0);
  if (x < T(0)) {
    if (x == accel::trunc(x)) return T(NAN);
    const double pi = 3.14159265358979323846;
    double r = double(x) - double(accel::trunc(x));
    result = -T(pi / accel::tan(pi * r));
    x = T(1) - x;
  }
  while (x < T(10)) {
    result -= T(1) / x;
    x += T(1);
  }
  if (x == T(10)) return result + psi_10;
  const T z = T(1) / (x * x);
  const T series =
      z * (T(1.0 / 12) -
           z * (T(1.0 / 120) -
                z * (T(1.0 / 252) -
                     z * (T(1.0 / 240) - z * (T(1.0 / 132) - z * (T(691.0 / 32760) - z * T(1.0 / 12)))))));
  return result + accel::log(x) - T(0.5) / x - series;
}

#endif /* ACCEL_SPECIAL_MATH_H */
