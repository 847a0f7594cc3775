/* The libm functions both backends wrap under accel:: names, as X-macro lists of
 * (name, float variant): the CPU and CUDA math headers expand them with their own
 * qualifiers. exp is not listed: the CPU backend has its own (Cephes). */
#ifndef ACCEL_LIBM_NAMES_H
#define ACCEL_LIBM_NAMES_H
#define ACCEL_LIBM_UNARY(X)                                                         \
  X(exp2, exp2f) X(expm1, expm1f) X(log, logf) X(log2, log2f) X(log10, log10f)      \
  X(log1p, log1pf) X(sin, sinf) X(cos, cosf) X(tan, tanf) X(asin, asinf)            \
  X(acos, acosf) X(atan, atanf) X(sinh, sinhf) X(cosh, coshf) X(tanh, tanhf)        \
  X(asinh, asinhf) X(acosh, acoshf) X(atanh, atanhf) X(erf, erff) X(erfc, erfcf)    \
  X(cbrt, cbrtf) X(sqrt, sqrtf) X(floor, floorf) X(ceil, ceilf) X(trunc, truncf)    \
  X(lgamma, lgammaf)
#define ACCEL_LIBM_BINARY(X)                                                        \
  X(pow, powf) X(atan2, atan2f) X(hypot, hypotf) X(fmod, fmodf)                     \
  X(nextafter, nextafterf) X(copysign, copysignf)
/* fmax/fmin: libm's on the GPU (eager's there: -0.0 below 0.0); the CPU header has its own
 * (eager's CPU kernels return the first operand where the two are zeros). */
#define ACCEL_LIBM_MINMAX(X) X(fmax, fmaxf) X(fmin, fminf)
#endif /* ACCEL_LIBM_NAMES_H */
