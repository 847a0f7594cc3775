/* 16-bit floats for generated kernels (CPU and CUDA alike): storage types and their exact
 * conversions to and from float32. Kernels never compute in them: every value is widened
 * to float32, computed on, and rounded back after each op, as ATen's kernels do (their
 * "opmath" type for Half and BFloat16 is float).
 *
 * The conversions are c10's, bit for bit: c10/util/BFloat16.h (round_to_nearest_even; NaN
 * becomes 0x7FC0) and c10/util/Half.h (fp16_ieee_from_fp32_value, fp16_ieee_to_fp32_value,
 * from Marat Dukhan's FP16 library), written with integer and float operations only, so a
 * compiler vectorizes them without F16C or AVX512-BF16 instructions. In CUDA device code
 * they are the conversion instructions c10 itself uses there (`__float2half`,
 * `__half2float`, and `__float2bfloat16` from sm_80 on): one instruction each, the same bits
 * as eager's CUDA kernels.
 *
 * float16 on an x86 CPU with AVX2 and F16C: the F16C instructions ATen's vectorized CPU
 * kernels convert with (vcvtph2ps; vcvtps2ph, round to nearest even: eager's bits, NaN
 * payloads included). gcc 12 vectorizes no conversion between float and float16 itself,
 * not even `_Float16`'s with AVX512-FP16 ("conversion not supported by target"), so each
 * is a function declared `omp declare simd` whose 8-lane variant (the x86-64 vector
 * function ABI's `_ZGVdN8v_` name for AVX2, `_ZGVeN8v_` for AVX-512: the same 8 lanes in a
 * ymm register) and, with AVX-512, 16-lane variant (`_ZGVeN16v_`, a zmm register: the
 * vectorizer's choice for a loop of 16 float lanes, one call where two 8-lane calls and
 * their spills were; float16 smooth_l1_loss on the CPU 15.2 -> 7.5 ms, eighty-first round)
 * are written here with the F16C / AVX-512 builtins (gcc's, not <immintrin.h>, which costs
 * every kernel 0.4 s to compile). Both widths are exhaustively the same bits.
 */
#ifndef ACCEL_HALF_H
#define ACCEL_HALF_H
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define ACCEL_HALF_FN __host__ __device__ __forceinline__
#else
#define ACCEL_HALF_FN static inline
#endif

namespace accel {

/* The bits of a torch.bfloat16 / torch.float16 value. Plain integers, not structs: gcc
 * vectorizes loops over integer locals, where a struct local under `omp simd` becomes an
 * aggregate copy it does not. */
typedef uint16_t bf16;
typedef uint16_t f16;

ACCEL_HALF_FN uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
ACCEL_HALF_FN float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

ACCEL_HALF_FN float bf16_to_float(bf16 v) { return f32_from_bits((uint32_t)v << 16); }

ACCEL_HALF_FN bf16 float_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __bfloat16_as_ushort(__float2bfloat16(f));
#else
  const uint32_t u = f32_bits(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (bf16)(f != f ? 0x7FC0u : r);
#endif
}

#if !defined(__CUDACC__) && defined(__AVX2__) && defined(__F16C__)
#define ACCEL_F16C 1
typedef int accel_v8si __attribute__((vector_size(32)));
typedef short accel_v8hi __attribute__((vector_size(16)));
typedef unsigned short accel_v8hu __attribute__((vector_size(16)));
typedef float accel_v8sf __attribute__((vector_size(32)));
typedef float accel_v4sf __attribute__((vector_size(16)));
typedef int accel_v16si __attribute__((vector_size(64)));
typedef short accel_v16hi __attribute__((vector_size(32)));
typedef unsigned short accel_v16hu __attribute__((vector_size(32)));
typedef float accel_v16sf __attribute__((vector_size(64)));
#ifdef __AVX512F__
/* 16 values widened / rounded to float16 (to nearest even): vcvtph2ps / vcvtps2ph on zmm */
static inline accel_v16sf f16c_widen16(accel_v16hi h) {
  return __builtin_ia32_vcvtph2ps512_mask(h, accel_v16sf{}, -1, 4);
}
static inline accel_v16hi f16c_narrow16(accel_v16sf f) {
  return __builtin_ia32_vcvtps2ph512_mask(f, 8, accel_v16hi{}, -1);
}
#endif
}  // namespace accel
extern "C" {
#pragma omp declare simd simdlen(8) notinbranch
#ifdef __AVX512F__
#pragma omp declare simd simdlen(16) notinbranch
#endif
__attribute__((const, nothrow)) float accel_f16c_h2f(int h);
#pragma omp declare simd simdlen(8) notinbranch
#ifdef __AVX512F__
#pragma omp declare simd simdlen(16) notinbranch
#endif
__attribute__((const, nothrow)) int accel_f16c_f2h(float f);
#pragma omp declare simd simdlen(8) notinbranch
#ifdef __AVX512F__
#pragma omp declare simd simdlen(16) notinbranch
#endif
__attribute__((const, nothrow)) float accel_f16c_round(float f);
__attribute__((visibility("hidden"))) accel::accel_v8sf _ZGVdN8v_accel_f16c_h2f(accel::accel_v8si h) {
  return __builtin_ia32_vcvtph2ps256(__builtin_convertvector(h, accel::accel_v8hi));
}
__attribute__((visibility("hidden"))) accel::accel_v8si _ZGVdN8v_accel_f16c_f2h(accel::accel_v8sf f) {
  return __builtin_convertvector((accel::accel_v8hu)__builtin_ia32_vcvtps2ph256(f, 8), accel::accel_v8si);
}
__attribute__((visibility("hidden"))) accel::accel_v8sf _ZGVdN8v_accel_f16c_round(accel::accel_v8sf f) {
  return __builtin_ia32_vcvtph2ps256(__builtin_ia32_vcvtps2ph256(f, 8));
}
#ifdef __AVX512F__
__attribute__((visibility("hidden"))) accel::accel_v16sf _ZGVeN16v_accel_f16c_h2f(accel::accel_v16si h) {
  return accel::f16c_widen16(__builtin_convertvector(h, accel::accel_v16hi));
}
__attribute__((visibility("hidden"))) accel::accel_v16si _ZGVeN16v_accel_f16c_f2h(accel::accel_v16sf f) {
  return __builtin_convertvector((accel::accel_v16hu)accel::f16c_narrow16(f), accel::accel_v16si);
}
__attribute__((visibility("hidden"))) accel::accel_v16sf _ZGVeN16v_accel_f16c_round(accel::accel_v16sf f) {
  return accel::f16c_widen16(accel::f16c_narrow16(f));
}
#endif
/* the AVX-512 names of the same 8-lane variants (gcc 12 with -march=native on an AVX-512
 * CPU calls these) */
__attribute__((visibility("hidden"), alias("_ZGVdN8v_accel_f16c_h2f")))
accel::accel_v8sf _ZGVeN8v_accel_f16c_h2f(accel::accel_v8si h);
__attribute__((visibility("hidden"), alias("_ZGVdN8v_accel_f16c_f2h")))
accel::accel_v8si _ZGVeN8v_accel_f16c_f2h(accel::accel_v8sf f);
__attribute__((visibility("hidden"), alias("_ZGVdN8v_accel_f16c_round")))
accel::accel_v8sf _ZGVeN8v_accel_f16c_round(accel::accel_v8sf f);
__attribute__((visibility("hidden"), used)) float accel_f16c_h2f_1(int h) {
  const accel::accel_v8hi v = {(short)h};
  return __builtin_ia32_vcvtph2ps(v)[0];
}
__attribute__((visibility("hidden"), used)) int accel_f16c_f2h_1(float f) {
  const accel::accel_v4sf v = {f};
  return (unsigned short)__builtin_ia32_vcvtps2ph(v, 8)[0];
}
__attribute__((visibility("hidden"), used)) float accel_f16c_round_1(float f) {
  const accel::accel_v4sf v = {f};
  return __builtin_ia32_vcvtph2ps(__builtin_ia32_vcvtps2ph(v, 8))[0];
}
}
/* the scalar entry points, defined where the compiler does not see it (a definition it
 * saw would make it build its own vector variants from the scalar body) */
__asm__(".globl accel_f16c_h2f\n.hidden accel_f16c_h2f\n.type accel_f16c_h2f, @function\n"
        "accel_f16c_h2f: jmp accel_f16c_h2f_1\n"
        ".globl accel_f16c_f2h\n.hidden accel_f16c_f2h\n.type accel_f16c_f2h, @function\n"
        "accel_f16c_f2h: jmp accel_f16c_f2h_1\n"
        ".globl accel_f16c_round\n.hidden accel_f16c_round\n.type accel_f16c_round, @function\n"
        "accel_f16c_round: jmp accel_f16c_round_1\n");
namespace accel {
#endif

ACCEL_HALF_FN float f16_to_float(f16 v) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(v));
#elif defined(ACCEL_F16C)
  return accel_f16c_h2f(v);
#else
  const uint32_t w = (uint32_t)v << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return f32_from_bits(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
#endif
}

ACCEL_HALF_FN f16 float_to_f16(float f) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half(f));
#elif defined(ACCEL_F16C)
  return (f16)accel_f16c_f2h(f);
#else
  float base = ((f < 0 ? -f : f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (f16)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

/* f rounded to float16 and widened back (an op's 16-bit result read by the next op): one
 * call on the F16C path, where the two conversions would be two */
ACCEL_HALF_FN float f16_round(float f) {
#ifdef ACCEL_F16C
  return accel_f16c_round(f);
#else
  return f16_to_float(float_to_f16(f));
#endif
}

#ifndef __CUDACC__
/* Whole rows at once, for CPU row kernels (a row of at most a few thousand values, in a
 * stack array): widen n float16 values, round n float32 values to float16 and back, narrow
 * n float32 values. With F16C these are explicit 8-lane conversions (16-lane with
 * AVX-512): inside a vectorized loop each conversion is a call of its vector variant,
 * around which gcc spills the loop's live vectors (softmax(x * 0.125) of float16 [8192,
 * 1024]: 6.5 -> 4.9 ms with the row's conversions done here). The same bits as the
 * element-wise functions above. */
#ifdef ACCEL_F16C
static inline void f16c_8(const f16* s, float* d) {  /* widen */
  accel_v8hi h;
  memcpy(&h, s, 16);
  const accel_v8sf f = __builtin_ia32_vcvtph2ps256(h);
  memcpy(d, &f, 32);
}
static inline void f16c_8(const float* s, f16* d) {  /* narrow */
  accel_v8sf f;
  memcpy(&f, s, 32);
  const accel_v8hi h = __builtin_ia32_vcvtps2ph256(f, 8);
  memcpy(d, &h, 16);
}
static inline void f16c_8(const float* s, float* d) {  /* round */
  accel_v8sf f;
  memcpy(&f, s, 32);
  f = __builtin_ia32_vcvtph2ps256(__builtin_ia32_vcvtps2ph256(f, 8));
  memcpy(d, &f, 32);
}
#ifdef __AVX512F__
static inline void f16c_16(const f16* s, float* d) {  /* widen */
  accel_v16hi h;
  memcpy(&h, s, 32);
  const accel_v16sf f = f16c_widen16(h);
  memcpy(d, &f, 64);
}
static inline void f16c_16(const float* s, f16* d) {  /* narrow */
  accel_v16sf f;
  memcpy(&f, s, 64);
  const accel_v16hi h = f16c_narrow16(f);
  memcpy(d, &h, 32);
}
static inline void f16c_16(const float* s, float* d) {  /* round */
  accel_v16sf f;
  memcpy(&f, s, 64);
  f = f16c_widen16(f16c_narrow16(f));
  memcpy(d, &f, 64);
}
#endif
#endif
static inline float f16_1(f16 x, float*) { return f16_to_float(x); }
static inline f16 f16_1(float x, f16*) { return float_to_f16(x); }
static inline float f16_1(float x, float*) { return f16_round(x); }

/* dst[i] = src[i] widened, narrowed or rounded (by the element types), 16 or 8 at a time */
template <typename S, typename D> static inline void f16_row(const S* src, D* dst, int64_t n) {
  int64_t i = 0;
#if defined(ACCEL_F16C) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) f16c_16(src + i, dst + i);
#endif
#ifdef ACCEL_F16C
  for (; i + 8 <= n; i += 8) f16c_8(src + i, dst + i);
#endif
  for (; i < n; ++i) dst[i] = f16_1(src[i], dst);
}
static inline void f16_widen_row(const f16* src, float* dst, int64_t n) { f16_row(src, dst, n); }
static inline void f16_round_row(float* x, int64_t n) { f16_row((const float*)x, x, n); }
static inline void f16_narrow_row(const float* src, f16* dst, int64_t n) { f16_row(src, dst, n); }
#endif

}  // namespace accel
#endif /* ACCEL_HALF_H */
