/* The vector variants of accel_fmodf and accel_fmod (vector_fmod.h, which says how they
 * compute), and their scalar entry points: included after cpu_math.h by the CPU kernels
 * that take an fmod (accel.codegen.cpp.CppRenderer.render), not by every kernel: about
 * 0.03 s of a kernel's build. */
#ifndef ACCEL_VECTOR_FMOD_VARIANTS_H
#define ACCEL_VECTOR_FMOD_VARIANTS_H
#include <string.h>
#include <type_traits>
#include "accel/vector_fmod.h"
#ifdef ACCEL_VECTOR_FMOD
namespace accel {
/* N float64 lanes (with their integer and float32 counterparts) */
template <int N>
struct fmod_lanes {
  typedef double d __attribute__((vector_size(8 * N)));
  typedef long long l __attribute__((vector_size(8 * N)));
  typedef unsigned long long u __attribute__((vector_size(8 * N)));
  typedef int i __attribute__((vector_size(4 * N)));
  typedef float f __attribute__((vector_size(4 * N)));
};
/* W lanes of T */
template <class T, int W>
using fmod_vec = std::conditional_t<sizeof(T) == 4, typename fmod_lanes<W>::f, typename fmod_lanes<W>::d>;

/* the float64 lanes a register holds: 8 with AVX-512, 4 with AVX2 (a wider generic vector
 * than the hardware's is taken apart lane by lane) */
#ifdef __AVX512F__
constexpr int kFmodLanes = 8;
static inline fmod_lanes<8>::d fma_lanes(fmod_lanes<8>::d a, fmod_lanes<8>::d b, fmod_lanes<8>::d c) {
  return __builtin_ia32_vfmaddpd512_mask(a, b, c, -1, 4);
}
#else
constexpr int kFmodLanes = 4;
#endif
static inline fmod_lanes<4>::d fma_lanes(fmod_lanes<4>::d a, fmod_lanes<4>::d b, fmod_lanes<4>::d c) {
  return __builtin_ia32_vfmaddpd256(a, b, c);
}

static inline fmod_lanes<8>::f fma_lanes(fmod_lanes<8>::f a, fmod_lanes<8>::f b, fmod_lanes<8>::f c) {
  return __builtin_ia32_vfmaddps256(a, b, c);
}
#ifdef __AVX512F__
static inline fmod_lanes<16>::f fma_lanes(fmod_lanes<16>::f a, fmod_lanes<16>::f b, fmod_lanes<16>::f c) {
  return __builtin_ia32_vfmaddps512_mask(a, b, c, -1, 4);
}
#endif

/* each lane rounded down (vroundps / vrndscaleps: -0 stays -0) */
static inline fmod_lanes<8>::f floor_lanes(fmod_lanes<8>::f x) { return __builtin_ia32_roundps256(x, 0x9); }
static inline fmod_lanes<4>::d floor_lanes(fmod_lanes<4>::d x) { return __builtin_ia32_roundpd256(x, 0x9); }
#ifdef __AVX512F__
static inline fmod_lanes<16>::f floor_lanes(fmod_lanes<16>::f x) { return __builtin_ia32_rndscaleps_mask(x, 0x9, x, -1, 4); }
static inline fmod_lanes<8>::d floor_lanes(fmod_lanes<8>::d x) { return __builtin_ia32_rndscalepd_mask(x, 0x9, x, -1, 4); }
#endif

/* whether any lane of a comparison's mask vector is set, by a vptest (it was an OR of the
 * lanes one by one: with that and floor division's slow path inline, one thread's float32
 * floor division of 8M values took 6.8-10.1 ms, against 5.1-5.3 without either) */
template <class M>
static inline bool any_lane(M m) {
  typedef long long q4 __attribute__((vector_size(32)));
  static_assert(sizeof(M) == 32 || sizeof(M) == 64, "a mask of 32 or 64 bytes");
  q4 v;
  memcpy(&v, &m, 32);
  if constexpr (sizeof(M) == 64) {
    q4 hi;
    memcpy(&hi, (const char*)&m + 32, 32);
    v |= hi;
  }
  return !__builtin_ia32_ptestz256(v, v);
}

/* fmod of W lanes of T in T's own arithmetic where every lane's |x| < 2^22 |y| (float32) or
 * 2^30 |y| (float64), x finite and y finite and not zero: one step of the algorithm
 * (vector_fmod.h) with q = trunc(x / y), whose rounded quotient is again within one of the
 * exact one; the
 * candidates, on |y|'s grid and below |y| in magnitude, are exact (subnormal ones too).
 * Without the reduction loop and, for float32, twice the lanes a register and no
 * conversions (float32 [1024, 1024] 2.4 -> 1.1 ms). False where a lane is outside those
 * bounds (out is then not written). */
template <class T, int W>
static inline bool fmod_one_step(fmod_vec<T, W> a, fmod_vec<T, W> b, fmod_vec<T, W>* out) {
  typedef fmod_vec<T, W> F;
  typedef std::conditional_t<sizeof(T) == 4, typename fmod_lanes<W>::i, typename fmod_lanes<W>::l> B;
  typedef std::conditional_t<sizeof(T) == 4, int, long long> E;
  constexpr E kSign = (E)((std::make_unsigned_t<E>)1 << (8 * sizeof(T) - 1));
  constexpr T kBound = sizeof(T) == 4 ? T(0x1p22) : T(0x1p30);
  const B sign = (B)a & kSign;
  const F x = (F)((B)a ^ sign), y = (F)((B)b & ~kSign);
  /* (NaN compares false: slow; an infinite y would make -0 * inf a NaN candidate) */
  const B slow = !(x < y * kBound) | (y == 0) | (y == T(__builtin_inf()));
  if (any_lane(slow)) return false;
  const F q = __builtin_convertvector(__builtin_convertvector(x / y, typename fmod_lanes<W>::i), F);
  const F t1 = fma_lanes(-(q + 1), y, x), t0 = fma_lanes(-q, y, x);
  const F r = t1 >= 0 ? t1 : t0 >= 0 ? t0 : t0 + y;
  *out = (F)((B)r | sign);
  return true;
}

/* fmod of W lanes of T (float or double; vector_fmod.h says how), in float64 registers of
 * kFmodLanes lanes reduced in one loop (their divisions overlap: float32, 2.2 -> 1.7 ns a
 * value against one register at a time) */
template <class T, int W>
static inline fmod_vec<T, W> fmod_lanes_of(fmod_vec<T, W> a, fmod_vec<T, W> b) {
  constexpr int N = W < kFmodLanes ? W : kFmodLanes, R = W / N;
  typedef fmod_lanes<N> V;
  typedef typename V::d D;
  typedef typename V::l L;
  typedef typename V::u U;
  typedef fmod_vec<T, N> H;  /* a register's lanes of T */
  constexpr long long kSign64 = (long long)0x8000000000000000ULL;
  {
    fmod_vec<T, W> out;
    if (fmod_one_step<T, W>(a, b, &out)) return out;
  }
  D r[R], d[R];
  L sign[R], more[R];
  L special = {};
  for (int k = 0; k < R; ++k) {
    H ah, bh;
    memcpy(&ah, (const char*)&a + k * sizeof(H), sizeof(H));
    memcpy(&bh, (const char*)&b + k * sizeof(H), sizeof(H));
    const D x = __builtin_convertvector(ah, D), y = __builtin_convertvector(bh, D);
    sign[k] = (L)x & kSign64;
    r[k] = (D)((L)x ^ sign[k]);
    d[k] = (D)((L)y & ~kSign64);
    special |= (r[k] != r[k]) | (d[k] != d[k]) | (d[k] < 0x1p-1022) | (r[k] == __builtin_inf());
  }
  if (any_lane(special)) {  /* NaN, infinite x, zero or float64-subnormal y: the C library's */
    fmod_vec<T, W> out;
    for (int k = 0; k < W; ++k) out[k] = c_fmod(a[k], b[k]);
    return out;
  }
  L any = {};
  for (int k = 0; k < R; ++k) any |= more[k] = r[k] >= d[k];
  while (any_lane(any)) {
    any = L{};
    for (int k = 0; k < R; ++k) {
      L e = (L)(((U)r[k] >> 52) - ((U)d[k] >> 52)) - 29;
      e = e > 0 ? e : 0;
      const D s = (D)((L)d[k] + (e << 52));  /* d 2^e: its exponent field raised */
      const D q = __builtin_convertvector(__builtin_convertvector(r[k] / s, typename V::i), D);
      const D t1 = fma_lanes(-(q + 1), s, r[k]), t0 = fma_lanes(-q, s, r[k]);
      r[k] = more[k] ? (t1 >= 0 ? t1 : t0 >= 0 ? t0 : t0 + s) : r[k];
      any |= more[k] = r[k] >= d[k];
    }
  }
  fmod_vec<T, W> out;
  for (int k = 0; k < R; ++k) {
    const H oh = __builtin_convertvector((D)((L)r[k] | sign[k]), H);
    memcpy((char*)&out + k * sizeof(H), &oh, sizeof(H));
  }
  return out;
}

/* floor division of W lanes of T (float or double), c10::div_floor_floating's bits
 * (vector_fmod.h says how): where every lane has |a / b| below 2^22 (float32) or 2^30
 * (float64) and b finite (a zero b makes a / b infinite or NaN), floor(a / b) corrected by
 * the sign of a - f b (a zero keeps q's sign, as c10's copysign: floor(-0) is -0, and a
 * corrected 1 is +0 where q > 0); else c10's formula lane by lane, with the C library's
 * fmod, out of line (the fast path then keeps everything in registers) */
template <class T, int W>
__attribute__((noinline, cold)) static fmod_vec<T, W> div_floor_c10_lanes(fmod_vec<T, W> a, fmod_vec<T, W> b) {
  fmod_vec<T, W> out;
  for (int k = 0; k < W; ++k) out[k] = div_floor_c10<T>(a[k], b[k]);
  return out;
}

template <class T, int W>
static inline fmod_vec<T, W> div_floor_lanes_of(fmod_vec<T, W> a, fmod_vec<T, W> b) {
  typedef fmod_vec<T, W> F;
  typedef std::conditional_t<sizeof(T) == 4, typename fmod_lanes<W>::i, typename fmod_lanes<W>::l> B;
  typedef std::conditional_t<sizeof(T) == 4, int, long long> E;
  constexpr E kSign = (E)((std::make_unsigned_t<E>)1 << (8 * sizeof(T) - 1));
  constexpr T kBound = sizeof(T) == 4 ? T(0x1p22) : T(0x1p30);
  const F q = a / b;
  /* (NaN compares false: slow) */
  const B slow = !((F)((B)q & ~kSign) < kBound) | !((F)((B)b & ~kSign) < T(__builtin_inf()));
  if (__builtin_expect(any_lane(slow), 0)) return div_floor_c10_lanes<T, W>(a, b);
  const F f = floor_lanes(q);  /* the floor of a / b, or one more (q rounded up to an integer) */
  const F r = fma_lanes(-f, b, a);
  return (r != 0) & ((r < 0) != (b < 0)) ? f - 1 : f;
}
}  // namespace accel

extern "C" {
/* f32 / f64's vector variants (float and double lanes, computed by impl<T, W>): AVX2's, their
 * AVX-512 names, and AVX-512's widths where it is on */
#define ACCEL_VARIANT(name, T, W, impl)                                                                               \
  __attribute__((visibility("hidden"))) accel::fmod_vec<T, W> name(accel::fmod_vec<T, W> a, accel::fmod_vec<T, W> b) { \
    return impl<T, W>(a, b);                                                                                          \
  }
#ifdef __AVX512F__
#define ACCEL_WIDE_VARIANTS(f32, f64, impl) \
  ACCEL_VARIANT(_ZGVeN16vv_##f32, float, 16, impl) ACCEL_VARIANT(_ZGVeN8vv_##f64, double, 8, impl)
#else
#define ACCEL_WIDE_VARIANTS(f32, f64, impl)
#endif
#define ACCEL_VARIANTS(f32, f64, impl)                                                                          \
  ACCEL_VARIANT(_ZGVdN8vv_##f32, float, 8, impl)                                                               \
  ACCEL_VARIANT(_ZGVdN4vv_##f64, double, 4, impl)                                                              \
  __attribute__((visibility("hidden"), alias("_ZGVdN8vv_" #f32)))                                             \
  accel::fmod_vec<float, 8> _ZGVeN8vv_##f32(accel::fmod_vec<float, 8> a, accel::fmod_vec<float, 8> b);        \
  __attribute__((visibility("hidden"), alias("_ZGVdN4vv_" #f64)))                                             \
  accel::fmod_vec<double, 4> _ZGVeN4vv_##f64(accel::fmod_vec<double, 4> a, accel::fmod_vec<double, 4> b);     \
  ACCEL_WIDE_VARIANTS(f32, f64, impl)
ACCEL_VARIANTS(accel_fmodf, accel_fmod, accel::fmod_lanes_of)
ACCEL_VARIANTS(accel_div_floorf, accel_div_floor, accel::div_floor_lanes_of)
#undef ACCEL_VARIANTS
#undef ACCEL_WIDE_VARIANTS
#undef ACCEL_VARIANT
__attribute__((visibility("hidden"), used)) float accel_fmodf_1(float a, float b) { return ::fmodf(a, b); }
__attribute__((visibility("hidden"), used)) double accel_fmod_1(double a, double b) { return ::fmod(a, b); }
__attribute__((visibility("hidden"), used)) float accel_div_floorf_1(float a, float b) { return accel::div_floor_c10(a, b); }
__attribute__((visibility("hidden"), used)) double accel_div_floor_1(double a, double b) { return accel::div_floor_c10(a, b); }
}
__asm__(".globl accel_fmodf\n.hidden accel_fmodf\n.type accel_fmodf, @function\n"
        "accel_fmodf: jmp accel_fmodf_1\n"
        ".globl accel_fmod\n.hidden accel_fmod\n.type accel_fmod, @function\n"
        "accel_fmod: jmp accel_fmod_1\n"
        ".globl accel_div_floorf\n.hidden accel_div_floorf\n.type accel_div_floorf, @function\n"
        "accel_div_floorf: jmp accel_div_floorf_1\n"
        ".globl accel_div_floor\n.hidden accel_div_floor\n.type accel_div_floor, @function\n"
        "accel_div_floor: jmp accel_div_floor_1\n");
#endif
#endif /* ACCEL_VECTOR_FMOD_VARIANTS_H */
