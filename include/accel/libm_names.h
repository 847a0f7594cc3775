/* The libm functions both backends wrap under accel:: names, as X-macro lists of
 * (name, float variant): the CPU and CUDA math headers expand them with their own
 * qualifiers. exp and lgamma are not listed: the CPU backend has its own (Cephes' exp, a
 * Lanczos lgamma: cpu_math.h), the CUDA one wraps CUDA's. */
#ifndef ACCEL_LIBM_NAMES_H
#define ACCEL_LIBM_NAMES_H
#define ACCEL_LIBM_UNARY(X)                                                         \
  X(exp2, exp2f) X(expm1, expm1f) X(log, logf) X(log2, log2f) X(log10, log10f)      \
  X(log1p, log1pf) X(sin, sinf) X(cos, cosf) X(tan, tanf) X(asin, asinf)            \
  X(acos, acosf) X(atan, atanf) X(sinh, sinhf) X(cosh, coshf) X(tanh, tanhf)        \
  X(asinh, asinhf) X(acosh, acoshf) X(atanh, atanhf) X(erf, erff) X(erfc, erfcf)    \
  X(cbrt, cbrtf) X(sqrt, sqrtf) X(floor, floorf) X(ceil, ceilf) X(trunc, truncf)
#define ACCEL_LIBM_BINARY(X) X(atan2, atan2f)
/* libm's on the GPU; the CPU header has its own: fmax/fmin (eager's CPU kernels return the
 * first operand where the two are zeros; on the GPU -0.0 is below 0.0, as libm's), pow
 * (gcc folds a constant exponent of 0.5 into sqrt), hypot (correctly rounded, as eager's
 * CPU kernel's), copysign (the sign bit as an integer: see signbit), fmod and nextafter
 * (vectorized: vector_fmod.h, cpu_math.h). */
#define ACCEL_LIBM_GPU(X)                                                           \
  X(pow, powf) X(fmax, fmaxf) X(fmin, fminf) X(hypot, hypotf) X(copysign, copysignf) \
  X(fmod, fmodf) X(nextafter, nextafterf)
#endif /* ACCEL_LIBM_NAMES_H */
