/* Scalar helpers shared by the CPU and CUDA math headers, which include this file inside
 * namespace accel after defining ACCEL_FN (``static inline`` on CPU, ``__device__
 * __forceinline__`` on the GPU) and accel::sqrt, accel::fmod, accel::exp, accel::tanh.
 * Semantics as ATen's kernels: NaN-propagating maximum/minimum, Python-style remainder,
 * sign(NaN) = 0, integer powers, well-defined out-of-range shifts, argmax/argmin taking the
 * first NaN. */
template <typename T> ACCEL_FN T rsqrt(T x) { return T(1) / accel::sqrt(x); }
template <typename T> ACCEL_FN T reciprocal(T x) { return T(1) / x; }
template <typename T> ACCEL_FN T maximum(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
  else return a > b ? a : b;
}
template <typename T> ACCEL_FN T minimum(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return (a != a) ? a : ((b != b) ? b : (a < b ? a : b));
  else return a < b ? a : b;
}
template <typename T> ACCEL_FN T remainder(T a, T b) {
  T m = accel::fmod(a, b);
  return (m != T(0) && ((b < T(0)) != (m < T(0)))) ? m + b : m;
}
template <typename T> ACCEL_FN T sign(T x) {
  if constexpr (std::is_same_v<T, bool>) return x;
  else return T((T(0) < x) - (x < T(0)));
}
/* Integer power as ATen's powi (aten/src/ATen/native/Pow.h): square-and-multiply, wrapping
 * as eager's does (here in the unsigned type, where wrapping is defined); a negative
 * exponent gives 1 for a base of 1, +-1 for a base of -1 and 0 otherwise. */
template <typename T> ACCEL_FN T powi(T a, T b) {
  if constexpr (std::is_signed_v<T>) {
    if (b < 0) return a == T(1) ? T(1) : a == T(-1) ? ((-b) % T(2) ? T(-1) : T(1)) : T(0);
  }
  using U = std::make_unsigned_t<T>;
  U result = 1, base = U(a);
  while (b) {
    if (b & 1) result = U(result * base);
    b /= 2;
    base = U(base * base);
  }
  return T(result);
}
template <typename T> ACCEL_FN T shift_left(T a, T b) {
  using U = std::make_unsigned_t<T>;
  constexpr T bits = sizeof(T) * 8;
  return (b < 0 || b >= bits) ? T(0) : T(U(a) << b);
}
template <typename T> ACCEL_FN T shift_right_arithmetic(T a, T b) {
  constexpr T bits = sizeof(T) * 8;
  return (b < 0 || b >= bits) ? T(a >> (bits - 1)) : T(a >> b);
}
/* Greatest common divisor of integers as ATen's calc_gcd (aten/src/ATen/native/Math.h):
 * Euclid's algorithm on the absolute values, gcd(0, 0) = 0. The absolute value of the
 * type's minimum wraps to itself, as std::abs does on eager's side, and the loop then runs
 * on the same signed remainders (b % a never divides the minimum by -1: a remainder turns
 * negative only once the minimum has been divided, and b never holds it again). */
template <typename T> ACCEL_FN T gcd(T a, T b) {
  if constexpr (std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    a = a < 0 ? T(U(0) - U(a)) : a;
    b = b < 0 ? T(U(0) - U(b)) : b;
  }
  while (a != 0) {
    T c = a;
    a = T(b % a);
    b = c;
  }
  return b;
}
/* Activations as eager computes them (aten/src/ATen/native/cpu/Activation.cpp). */
template <typename T> ACCEL_FN T silu(T x) { return x / (T(1) + accel::exp(-x)); }
/* GELU's tanh form as both devices' kernels associate it (Activation.cpp's GeluKernelImpl,
 * ActivationGeluKernel.cu): kKappa times the cube x * x * x. */
template <typename T> ACCEL_FN T gelu_tanh(T x) {
  const T kBeta = T(M_SQRT2 * M_2_SQRTPI * 0.5), kKappa = T(0.044715);
  const T x_cube = x * x * x;
  return T(0.5) * x * (T(1) + accel::tanh(kBeta * (x + kKappa * x_cube)));
}
template <typename T> ACCEL_FN bool argmax_better(T v, T best) {
  if constexpr (std::is_floating_point_v<T>) return v > best || (v != v && best == best);
  else return v > best;
}
template <typename T> ACCEL_FN bool argmin_better(T v, T best) {
  if constexpr (std::is_floating_point_v<T>) return v < best || (v != v && best == best);
  else return v < best;
}
