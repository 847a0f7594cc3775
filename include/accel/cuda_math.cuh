/* Device helpers for generated CUDA kernels (included, never pasted): the math the C++
 * backend takes from cpu_math.h, under the same names, and block-wide reductions.
 *
 * Semantics follow ATen's CUDA kernels (aten/src/ATen/native/cuda/*.cu): NaN-propagating
 * maximum/minimum, Python-style remainder, sign(NaN) = 0, argmax/argmin taking the first
 * NaN or the first extreme. No fast math: CUDA's libdevice functions are within 2 ulp.
 */
#ifndef ACCEL_CUDA_MATH_CUH
#define ACCEL_CUDA_MATH_CUH
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <limits>
#include <type_traits>
#include "accel/kernel.h"
#include "accel/half.h"
#include "accel/libm_names.h"

/* A CUDA kernel's arguments, passed by value (the kernel ABI, accel/kernel.h): the N buffer
 * addresses and the M runtime scalars of its region. */
template <int N> struct accel_bufs { void* p[N]; };
template <int N> struct accel_scalars { accel_scalar_t v[N]; };

namespace accel {

#define ACCEL_UNARY(name, f32)                                                     \
  __device__ __forceinline__ float name(float x) { return ::f32(x); }              \
  __device__ __forceinline__ double name(double x) { return ::name(x); }
ACCEL_UNARY(exp, expf) ACCEL_UNARY(lgamma, lgammaf) ACCEL_LIBM_UNARY(ACCEL_UNARY)
#undef ACCEL_UNARY
/* digamma (psi, the derivative of lgamma; what `torch.digamma` and lgamma's backward
 * compute), in the argument's precision, by the method of eager's CUDA kernel (ATen's
 * calc_digamma, ATen/native/Math.h, after Cephes' psi), written from the formulas of
 * Abramowitz and Stegun, Handbook of Mathematical Functions (1964):
 *   - psi(+-0) = -+inf, psi at a negative integer NaN (a pole);
 *   - x < 0, reflection (6.3.7): psi(x) = psi(1 - x) - pi / tan(pi r), r the fractional
 *     part of x (taken apart first: tan(pi r) is exact where pi x is not), in double;
 *   - recurrence (6.3.5): psi(x) = psi(x + 1) - 1 / x, up to x >= 10; psi(10) exactly;
 *   - asymptotic series (6.3.18): psi(x) = ln x - 1 / (2x) - sum_k B_2k / (2k x^2k), seven
 *     terms (B_2k the Bernoulli numbers: 1/12, -1/120, 1/252, -1/240, 1/132, -691/32760,
 *     1/12 for k = 1..7).
 * (The CPU's, cpu_math.h, computes the same formulas in float64 without a loop.) */
template <typename T>
__device__ __forceinline__ T digamma(T x) {
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
/* erfinv as eager's CUDA kernel computes it (CUDA's erfinvf / erfinv; on the CPU erfinv
 * runs eagerly: accel/ops.py, RUNS_EAGERLY) */
__device__ __forceinline__ float erf_inv(float x) { return ::erfinvf(x); }
__device__ __forceinline__ double erf_inv(double x) { return ::erfinv(x); }

#define ACCEL_BINARY(name, f32)                                                              \
  __device__ __forceinline__ float name(float a, float b) { return ::f32(a, b); }            \
  __device__ __forceinline__ double name(double a, double b) { return ::name(a, b); }
ACCEL_LIBM_BINARY(ACCEL_BINARY)
ACCEL_LIBM_GPU(ACCEL_BINARY)
__device__ __forceinline__ float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
__device__ __forceinline__ double fma(double a, double b, double c) { return ::fma(a, b, c); }
/* a * b rounded on its own, never contracted into a fused multiply-add (accel.library.mul_rn) */
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
/* a / b correctly rounded, never a product with b's reciprocal (accel.library.div_rn) */
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
#undef ACCEL_BINARY

/* rsqrt as eager's CUDA kernels take it (rsqrt_kernel_cuda's ::rsqrt, the normalizations'
 * c10::cuda::compat::rsqrt): CUDA's rsqrtf (2 ulp), not 1 / sqrt; preferred over
 * scalar_ops.h's template, the CPU's form */
__device__ __forceinline__ float rsqrt(float x) { return ::rsqrtf(x); }
__device__ __forceinline__ double rsqrt(double x) { return ::rsqrt(x); }

__device__ __forceinline__ float round(float x) { return ::rintf(x); }  /* half to even */
__device__ __forceinline__ double round(double x) { return ::rint(x); }

template <typename T> __device__ __forceinline__ T abs(T x) {
  if constexpr (std::is_floating_point_v<T>) return ::fabs(x);
  else return x < 0 ? T(-x) : x;
}
template <typename T> __device__ __forceinline__ bool signbit(T x) {
  if constexpr (std::is_floating_point_v<T>) return ::signbit(x);
  else return x < 0;
}
template <typename T> __device__ __forceinline__ bool isfinite(T x) {
  if constexpr (std::is_floating_point_v<T>) return ::isfinite(x);
  else return true;
}
#define ACCEL_FN __device__ __forceinline__
#include "accel/scalar_ops.h"
#undef ACCEL_FN

/* -- block-wide reductions: every thread of the block calls them and gets the result ---- */
struct Sum { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct Prod { template <typename T> __device__ T operator()(T a, T b) const { return a * b; } };
struct Max { template <typename T> __device__ T operator()(T a, T b) const { return maximum(a, b); } };
struct Min { template <typename T> __device__ T operator()(T a, T b) const { return minimum(a, b); } };

template <typename T> __device__ __forceinline__ T shfl_xor(T v, int lane) {
  if constexpr (sizeof(T) < 4) return T(__shfl_xor_sync(0xffffffffu, int(v), lane));
  else return __shfl_xor_sync(0xffffffffu, v, lane);
}

/* The ``nw`` warps' partial results ``s[0..nw)``, combined in every thread: where ``nw`` is
 * a power of two (every block size accel picks), lane l reads s[l % nw] and the lanes of
 * each group of nw shuffle them together (a butterfly of a commutative ``f``: every thread
 * gets the same bits), one read of shared memory a thread instead of nw (softmax's row
 * kernel 1 % faster on the H100, LayerNorm's 2 %); otherwise the partials in order. */
template <typename T, typename F> __device__ __forceinline__ T warp_partials(const T* s, int nw, F f) {
  if ((nw & (nw - 1)) == 0) {
    T v = s[(threadIdx.x & 31) & (nw - 1)];
    for (int o = nw >> 1; o > 0; o >>= 1) v = f(v, shfl_xor(v, o));
    return v;
  }
  T v = s[0];
  for (int w = 1; w < nw; ++w) v = f(v, s[w]);
  return v;
}

/* The barrier of a block reduction's shared scratch: the block's, or the warp's where a
 * block of 32 threads a row runs one row per warp (blockDim.y rows, CudaRenderer's
 * ROW_WARPS), each warp with scratch of its own. (No block reduction spans threadIdx.y.) */
__device__ __forceinline__ void block_sync() {
  if (blockDim.x == 32) __syncwarp();
  else __syncthreads();
}

/* Warp shuffles, then the warps' results through shared memory (``scratch``: 32 slots of
 * at least 8 bytes, shared by the block). */
template <typename T, typename F>
__device__ T block_reduce(T v, F f, void* scratch) {
  T* s = reinterpret_cast<T*>(scratch);
  for (int o = 16; o > 0; o >>= 1) v = f(v, shfl_xor(v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  block_sync();
  if (lane == 0) s[warp] = v;
  block_sync();
  return warp_partials(s, nw, f);
}

/* Vectors (elementwise and row kernels' aligned loads and stores): vec_t<T, 4> is 16 bytes
 * of 4-byte elements or 8 of 16-bit floats, vec_t<uint16_t, 8> 16 bytes of 16-bit floats
 * (elementwise kernels). ``lane``/``lane_ref`` with a constant index after unrolling stay
 * in registers. */
struct __align__(16) u16x8 { uint16_t v[8]; };
template <typename T, int N> struct vec {};
template <> struct vec<float, 4> { using type = float4; };
template <> struct vec<int32_t, 4> { using type = int4; };
template <> struct vec<uint16_t, 4> { using type = ushort4; };  /* bf16, f16 */
template <> struct vec<uint16_t, 8> { using type = u16x8; };
template <typename T, int N> using vec_t = typename vec<T, N>::type;
template <typename V> __device__ __forceinline__ auto lane(const V& a, int v) {
  return v == 0 ? a.x : v == 1 ? a.y : v == 2 ? a.z : a.w;
}
template <typename V> __device__ __forceinline__ auto& lane_ref(V& a, int v) {
  return v == 0 ? a.x : v == 1 ? a.y : v == 2 ? a.z : a.w;
}
__device__ __forceinline__ uint16_t lane(const u16x8& a, int v) { return a.v[v]; }
__device__ __forceinline__ uint16_t& lane_ref(u16x8& a, int v) { return a.v[v]; }
/* L2 eviction priorities of a read, as Inductor's Triton loads take them in a long row's
 * passes: L2_KEEP where a later pass of the row reads the element again (``evict_last``),
 * L2_LAST in the last pass that reads it (``evict_first``). H200, bench/long_rows.py, ms
 * back to back: LayerNorm [2048, 32768] float32 0.196 -> 0.180; GroupNorm(32) + SiLU
 * [64, 256, 64, 64] 0.92x -> 0.96x of torch.compile's speed (bench/README.md, 44th round). */
enum { L2_NORMAL = 0, L2_KEEP = 1, L2_LAST = 2 };
/* A whole vector read through the read-only data path (``__ldg``, or ``ld.global.nc`` with
 * an L2 cache policy of priority ``H`` on sm_80 and later): one 8- or 16-byte load that
 * nvcc neither narrows to the lane it is used for nor repeats for each lane (row kernels
 * read their buffers this way; they never write what they read). */
template <int H = L2_NORMAL, typename V> __device__ __forceinline__ V load_vec(const V* p) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 8, "8- or 16-byte vectors");
  V r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (H != L2_NORMAL) {
    uint64_t policy;
    if constexpr (H == L2_KEEP) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    else asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    uint32_t* u = reinterpret_cast<uint32_t*>(&r);
    if constexpr (sizeof(V) == 16)
      asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3]) : "l"(p), "l"(policy));
    else
      asm("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;" : "=r"(u[0]), "=r"(u[1]) : "l"(p), "l"(policy));
    return r;
  }
#endif
  if constexpr (sizeof(V) == 16) *reinterpret_cast<uint4*>(&r) = __ldg(reinterpret_cast<const uint4*>(p));
  else *reinterpret_cast<uint2*>(&r) = __ldg(reinterpret_cast<const uint2*>(p));
  return r;
}
/* ``reg``, first loaded from ``p`` where ``first`` (a row kernel's unrolled lanes: the
 * vector's first lane loads it, the others read the register). */
template <int H = L2_NORMAL, typename V>
__device__ __forceinline__ const V& load_once(V& reg, const V* p, bool first) {
  if (first) reg = load_vec<H>(p);
  return reg;
}

/* A partial written by another block, read past L1 (``__ldcg``; a bool through its byte,
 * which ``__ldcg`` has no overload for). */
template <typename T> __device__ __forceinline__ T load_cg(const T* p) { return __ldcg(p); }
__device__ __forceinline__ bool load_cg(const bool* p) {
  return __ldcg(reinterpret_cast<const unsigned char*>(p)) != 0;
}

/* Grid mode: every thread of every block calls this with its own ``v``; the
 * block that finishes last gets true and ``v`` combined over the partials in block order
 * (``part``: gridDim.x slots, at most blockDim.x); the others get false. ``count`` is 0 on
 * entry and again on return. CUDA's threadFenceReduction sample. */
template <typename T, typename F>
__device__ bool grid_reduce(T& v, F f, T init, T* part, unsigned int* count, void* scratch) {
  __shared__ bool last;
  v = block_reduce(v, f, scratch);
  if (threadIdx.x == 0) {
    part[blockIdx.x] = v;
    __threadfence();
    last = atomicAdd(count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return false;
  __threadfence();
  T p = threadIdx.x < gridDim.x ? load_cg(part + threadIdx.x) : init;
  v = block_reduce(p, f, scratch);
  if (threadIdx.x == 0) *count = 0;
  return true;
}

/* Column mode: combine ``v`` over the block's rows of threads (blockDim.y, a power of 2;
 * blockDim.x at most 32); every thread gets its column's result. */
template <typename T, typename F>
__device__ T col_reduce(T v, F f) {
  __shared__ T s[32 * 32];
  const int x = threadIdx.x, y = threadIdx.y;
  __syncthreads();
  s[y * 32 + x] = v;
  __syncthreads();
  for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
    if (y < h) s[y * 32 + x] = f(s[y * 32 + x], s[(y + h) * 32 + x]);
    __syncthreads();
  }
  return s[x];
}

/* Column mode with the rows split among gridDim.y blocks a tile (one tile a block):
 * col_part writes this block's column results (after col_reduce) to ``part`` ([block row]
 * [tile][column]); col_ticket is true in the tile's last block to finish (``count``: one
 * counter a tile, 0 on entry and reset by that block); col_combine then combines the
 * partials in block order. As grid_reduce: CUDA's threadFenceReduction sample. */
template <typename T>
__device__ void col_part(T v, T* part, int64_t tile, int64_t tiles) {
  if (threadIdx.y == 0) part[(blockIdx.y * tiles + tile) * 32 + threadIdx.x] = v;
}
__device__ __forceinline__ bool col_ticket(unsigned int* count, int64_t tile) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    last = atomicAdd(count + tile, 1u) == gridDim.y - 1;
    if (last) count[tile] = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}
template <typename T, typename F>
__device__ T col_combine(const T* part, F f, int64_t tile, int64_t tiles) {
  T v = load_cg(part + tile * 32 + threadIdx.x);
  for (unsigned int s = 1; s < gridDim.y; ++s) v = f(v, load_cg(part + (s * tiles + tile) * 32 + threadIdx.x));
  return v;
}

/* Block loops with each row split among gridDim.y blocks (a block a row): row_part writes
 * this block's result (after the block's reduction) to ``part`` ([block row][row]); the
 * row's last block (col_ticket, one counter a row) combines the partials in block order
 * with row_combine, every thread. As grid_reduce: CUDA's threadFenceReduction sample. */
template <typename T>
__device__ void row_part(T v, T* part, int64_t row, int64_t rows) {
  if (threadIdx.x == 0) part[blockIdx.y * rows + row] = v;
}
template <typename T, typename F>
__device__ T row_combine(const T* part, F f, int64_t row, int64_t rows) {
  T v = load_cg(part + row);
  for (unsigned int s = 1; s < gridDim.y; ++s) v = f(v, load_cg(part + s * rows + row));
  return v;
}

/* The (value, index) of an argmax/argmin (index INT64_MAX: no value yet), and their
 * combination, for column mode and block_arg: the better value, the smaller index on a
 * tie (a thread's elements come in order, so the first of equal values wins, as eager's). */
template <typename T> struct ArgPair {
  T v;
  int64_t i;
};
template <typename T> __device__ __forceinline__ ArgPair<T> load_cg(const ArgPair<T>* p) {
  return {__ldcg(&p->v), __ldcg(&p->i)};  // (the partials bypass L1)
}
template <bool kMax> struct ArgCombine {
  template <typename T> __device__ ArgPair<T> operator()(ArgPair<T> a, ArgPair<T> b) const {
    const bool ab = kMax ? argmax_better(a.v, b.v) : argmin_better(a.v, b.v);
    const bool ba = kMax ? argmax_better(b.v, a.v) : argmin_better(b.v, a.v);
    return ab || (!ba && a.i < b.i) ? a : b;
  }
};

/* (value, index) for argmax/argmin over a block (ArgCombine's rule). */
template <typename T, bool kMax>
__device__ void block_arg(T& v, int64_t& i, void* scratch) {
  const ArgCombine<kMax> combine;
  auto take = [&](T ov, int64_t oi) {
    const ArgPair<T> p = combine(ArgPair<T>{ov, oi}, ArgPair<T>{v, i});
    v = p.v; i = p.i;
  };
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = shfl_xor(v, o);
    take(ov, __shfl_xor_sync(0xffffffffu, i, o));
  }
  T* sv = reinterpret_cast<T*>(scratch);
  int64_t* si = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(scratch) + 32 * 8);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  block_sync();
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  block_sync();
  v = sv[0]; i = si[0];
  for (int w = 1; w < nw; ++w) take(sv[w], si[w]);
}

/* Mean and variance: (count, mean, sum of squared deviations) of a set of values, and their
 * merge by the pairwise rule of Chan, Golub & LeVeque (1979). */
template <typename T> struct Moments {
  T n, mean, m2;
};
template <typename T> __device__ __forceinline__ Moments<T> merge_moments(Moments<T> a, Moments<T> b) {
  if (b.n == T(0)) return a;
  if (a.n == T(0)) return b;
  const T nt = a.n + b.n, delta = b.mean - a.mean;
  return {nt, a.mean + delta * (b.n / nt), a.m2 + b.m2 + delta * delta * (a.n * (b.n / nt))};
}
template <typename T> __device__ __forceinline__ Moments<T> load_cg(const Moments<T>* p) {
  return {__ldcg(&p->n), __ldcg(&p->mean), __ldcg(&p->m2)};  // (the partials bypass L1)
}
struct MergeMoments {
  template <typename T> __device__ Moments<T> operator()(Moments<T> a, Moments<T> b) const {
    return merge_moments(a, b);
  }
};

/* A running softmax maximum m and sum s of exp(x - m), a value at a time, and the merge of
 * two (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"): one pass
 * over memory in column mode and in block loops (rows too long for registers). Special
 * values as accel.library.online_softmax's: a -inf adds 0 (s stays 0 while every value seen
 * is -inf), a NaN makes both NaN, a +inf makes s NaN (exp(inf - inf), as in eager's sum).
 * Start from {-INFINITY, 0}. */
template <typename T> struct SoftmaxState {
  T m, s;
  __device__ __forceinline__ void add(T x) {  // selects, one exp: no divergent branches
    const bool up = x > m;
    const T e = accel::exp(up ? m - x : x - m);
    const T t = up ? s * e + (T(1) + (x - x)) : s + (x == -T(INFINITY) ? T(0) : e);  // x - x: NaN for +inf
    m = maximum(m, x);
    s = x != x ? x : t;
  }
};
template <typename T> __device__ __forceinline__ SoftmaxState<T> load_cg(const SoftmaxState<T>* p) {
  return {__ldcg(&p->m), __ldcg(&p->s)};  // (the partials bypass L1)
}
template <typename T> __device__ __forceinline__ SoftmaxState<T> shfl_xor(SoftmaxState<T> v, int lane) {
  return {shfl_xor(v.m, lane), shfl_xor(v.s, lane)};  // (block_reduce's butterfly: MergeSoftmax commutes)
}
struct MergeSoftmax {
  template <typename T> __device__ SoftmaxState<T> operator()(SoftmaxState<T> a, SoftmaxState<T> b) const {
    const T m = maximum(a.m, b.m);
    if (m == -T(INFINITY)) return {m, T(0)};
    return {m, a.s * accel::exp(a.m - m) + b.s * accel::exp(b.m - m)};
  }
};

/* One thread's values, as sums of x - k and (x - k)^2 with k its first value ("shifted
 * data", Chan, Golub & LeVeque 1983): no division per value, and no cancellation against
 * a mean far from zero, as a plain sum of squares would suffer. */
template <typename T> struct ShiftedMoments {
  T n = 0, k = 0, s = 0, q = 0;
  __device__ __forceinline__ void add(T x) {
    if (n == T(0)) k = x;
    const T d = x - k;
    n += T(1);
    s += d;
    q += d * d;
  }
  __device__ __forceinline__ Moments<T> moments() const {
    if (n == T(0)) return {T(0), T(0), T(0)};
    const T m = s / n;
    return {n, k + m, q - s * m};
  }
};

/* The same shifted sums in a wider type (a thread's float32 sums, merged in float64). */
template <typename T, typename U> __device__ __forceinline__ ShiftedMoments<T> widen(const ShiftedMoments<U>& a) {
  ShiftedMoments<T> w;
  w.n = T(a.n); w.k = T(a.k); w.s = T(a.s); w.q = T(a.q);
  return w;
}

/* Block mode (blockDim.x a multiple of 32, every thread calling): each warp's shifted
 * sums moved to the shift of its first lane that has values (a shuffle, no shared memory)
 * and summed by a butterfly; the warps' sums then moved to the first such warp's shift and
 * merged in warp order by every thread (``scratch``: 128 values of T), so every thread gets
 * the same bits. Two barriers a reduction: on the H100 a [16384, 4096] residual-add +
 * LayerNorm kernel 282 -> 277 us against the earlier block-wide shift (thread 0's, shared
 * through memory: four barriers). */
template <typename T> __device__ Moments<T> block_moments(const ShiftedMoments<T>& a, void* scratch) {
  T* s = reinterpret_cast<T*>(scratch);
  const unsigned has = __ballot_sync(0xffffffffu, a.n > T(0));
  const T kw = has ? __shfl_sync(0xffffffffu, a.k, __ffs(has) - 1) : T(0);
  const T d = a.n > T(0) ? a.k - kw : T(0);
  T n = a.n, sum = a.s + a.n * d, sq = a.q + d * (T(2) * a.s + a.n * d);
  for (int o = 16; o > 0; o >>= 1) {
    n += shfl_xor(n, o);
    sum += shfl_xor(sum, o);
    sq += shfl_xor(sq, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  block_sync();
  if (lane == 0) { s[warp] = kw; s[32 + warp] = n; s[64 + warp] = sum; s[96 + warp] = sq; }
  block_sync();
  int w0 = 0;  // the first warp with values (warp 0 wherever the row is not empty)
  while (w0 < nw - 1 && s[32 + w0] == T(0)) ++w0;
  const T K = s[w0];
  T N = 0, S = 0, Q = 0;
  for (int w = 0; w < nw; ++w) {
    const T nw_ = s[32 + w];
    if (nw_ > T(0)) {
      const T dw = s[w] - K, sw = s[64 + w];
      N += nw_;
      S += sw + nw_ * dw;
      Q += s[96 + w] + dw * (T(2) * sw + nw_ * dw);
    }
  }
  if (N == T(0)) return {T(0), T(0), T(0)};
  const T m = S / N;
  return {N, K + m, Q - S * m};
}

}  // namespace accel
#endif /* ACCEL_CUDA_MATH_CUH */
