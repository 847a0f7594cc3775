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
#include "accel/libm_names.h"

namespace accel {

#define ACCEL_UNARY(name, f32)                                                     \
  __device__ __forceinline__ float name(float x) { return ::f32(x); }              \
  __device__ __forceinline__ double name(double x) { return ::name(x); }
ACCEL_UNARY(exp, expf) ACCEL_LIBM_UNARY(ACCEL_UNARY)
#undef ACCEL_UNARY

#define ACCEL_BINARY(name, f32)                                                              \
  __device__ __forceinline__ float name(float a, float b) { return ::f32(a, b); }            \
  __device__ __forceinline__ double name(double a, double b) { return ::name(a, b); }
ACCEL_LIBM_BINARY(ACCEL_BINARY)
#undef ACCEL_BINARY

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

/* Warp shuffles, then the warps' results through shared memory (``scratch``: 32 slots of
 * at least 8 bytes, shared by the block). */
template <typename T, typename F>
__device__ T block_reduce(T v, F f, void* scratch) {
  T* s = reinterpret_cast<T*>(scratch);
  for (int o = 16; o > 0; o >>= 1) v = f(v, shfl_xor(v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = s[0];
  for (int w = 1; w < nw; ++w) v = f(v, s[w]);
  return v;
}

/* 16-byte vectors of 4-byte elements (elementwise kernels' aligned loads and stores);
 * ``lane`` with a constant index after unrolling stays in registers. */
template <typename T> struct vec4 {};
template <> struct vec4<float> { using type = float4; };
template <> struct vec4<int32_t> { using type = int4; };
template <typename T> using vec4_t = typename vec4<T>::type;
template <typename V> __device__ __forceinline__ auto lane(const V& a, int v) {
  return v == 0 ? a.x : v == 1 ? a.y : v == 2 ? a.z : a.w;
}
template <typename V> __device__ __forceinline__ auto& lane_ref(V& a, int v) {
  return v == 0 ? a.x : v == 1 ? a.y : v == 2 ? a.z : a.w;
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
  T p = threadIdx.x < gridDim.x ? __ldcg(part + threadIdx.x) : init;
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

/* (value, index) for argmax/argmin: the better value, the smaller index on a tie. */
template <typename T, bool kMax>
__device__ void block_arg(T& v, int64_t& i, void* scratch) {
  auto better = [](T a, int64_t ia, T b, int64_t ib) {
    const bool ab = kMax ? argmax_better(a, b) : argmin_better(a, b);
    const bool ba = kMax ? argmax_better(b, a) : argmin_better(b, a);
    return ab || (!ba && ia < ib);
  };
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = shfl_xor(v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
  T* sv = reinterpret_cast<T*>(scratch);
  int64_t* si = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(scratch) + 32 * 8);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  v = sv[0]; i = si[0];
  for (int w = 1; w < nw; ++w)
    if (better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
}

/* Welford's (count, mean, m2), merged by Chan et al.'s pairwise rule. */
template <typename T> struct Welford {
  T n = 0, mean = 0, m2 = 0;
  __device__ void add(T x) {
    n += T(1);
    const T d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }
  __device__ void merge(T nb, T mb, T qb) {
    if (nb == T(0)) return;
    const T nt = n + nb, delta = mb - mean;
    mean += delta * (nb / nt);
    m2 += qb + delta * delta * (n * nb / nt);
    n = nt;
  }
  __device__ T mean_or_nan() const { return n > T(0) ? mean : T(NAN); }
  __device__ void block(void* scratch) {
    for (int o = 16; o > 0; o >>= 1)
      merge(shfl_xor(n, o), shfl_xor(mean, o), shfl_xor(m2, o));
    T* s = reinterpret_cast<T*>(scratch);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) { s[warp] = n; s[32 + warp] = mean; s[64 + warp] = m2; }
    __syncthreads();
    n = s[0]; mean = s[32]; m2 = s[64];
    for (int w = 1; w < nw; ++w) merge(s[w], s[32 + w], s[64 + w]);
  }
};

}  // namespace accel
#endif /* ACCEL_CUDA_MATH_CUH */
