// accel's float32 matrix multiply on x86 CPUs with AVX-512: C = bias + A @ B, batched.
//
// Why: on AMD Zen CPUs MKL's sgemm (eager's and torch.compile's CPU matmul) takes a generic
// AVX2 path, about half the machine's peak (on the dev VM's EPYC: 190-225 GFLOP/s of two
// cores against 380-430 here); a CPU training step's matmuls are most of its time.
//
// The algorithm is the BLIS one (Van Zee and van de Geijn, "BLIS: A Framework for Rapidly
// Instantiating BLAS Functionality", ACM TOMS 2015; Goto and van de Geijn, "Anatomy of
// High-Performance Matrix Multiplication", ACM TOMS 2008): the product is cut into tiles of
// kMC x kNB outputs, one tile a task (at::parallel_for over batch x row blocks x column
// blocks); a tile packs its A rows and B columns one block of K at a time into contiguous
// panels (any strides, so transposed operands cost nothing extra) and runs a register-
// blocked micro-kernel of kMR x kNR outputs (24 zmm accumulators) over them.
//
// Numerics: each output is a chain of fused multiply-adds over one block of K, in order,
// and the blocks' sums are added to the output in order. The blocks follow MKL's sgemm on
// the dev VM (k_blocks() below): results there are bit for bit MKL's for every even K (and
// for every K outside 193..383), so accel's matmuls give eager's numbers; elsewhere the
// error stays that of a blocked sum (a chain of at most kKC terms per block).
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace accel_gemm {

constexpr int kMR = 12;   // micro-kernel rows: 12 x 2 zmm accumulators
constexpr int kNR = 32;   // micro-kernel columns: two zmm
constexpr int kKC = 192;  // a block of K (MKL's, see the top of the file)
constexpr int kMC = 48;   // rows of a tile
constexpr int kNB = 512;  // columns of a tile

// The length of the block of K that starts at `pc` (of K in all): blocks of kKC, except
// that a K between kKC and 2 kKC is cut in two halves.
inline int64_t k_block(int64_t K, int64_t pc) {
  if (K > kKC && K <= 2 * kKC) return pc == 0 ? K / 2 : K - K / 2;
  return std::min<int64_t>(kKC, K - pc);
}

// Operands: element (b, i, j) at base + b * sb + i * s0 + j * s1.
struct Operand {
  const float* p;
  int64_t sb, s0, s1;
};

// C tile (mr x nr, at most kMR x kNR, row stride ldc) = [bias +] or [C +] the product of a
// packed A panel ([kc][kMR]) and a packed B panel ([kc][kNR]). first: the first block of K
// (C written, from bias where given: element (i, j) at bias + i * bs0 + j * bs1).
__attribute__((target("avx512f,fma"))) inline void micro(
    int64_t kc, const float* __restrict ap, const float* __restrict bp, float* __restrict c,
    int64_t ldc, int mr, int nr, bool first, const float* bias, int64_t bs0, int64_t bs1) {
  __m512 c0[kMR], c1[kMR];
#pragma GCC unroll 12
  for (int i = 0; i < kMR; ++i) {
    c0[i] = _mm512_setzero_ps();
    c1[i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m512 b0 = _mm512_load_ps(bp + k * kNR);
    __m512 b1 = _mm512_load_ps(bp + k * kNR + 16);
#pragma GCC unroll 12
    for (int i = 0; i < kMR; ++i) {
      __m512 a = _mm512_set1_ps(ap[k * kMR + i]);
      c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
    }
  }
  if (mr == kMR && nr == kNR && (!first || bias == nullptr || bs1 == 1)) {
#pragma GCC unroll 12
    for (int i = 0; i < kMR; ++i) {
      float* ci = c + i * ldc;
      if (!first) {
        c0[i] = _mm512_add_ps(_mm512_loadu_ps(ci), c0[i]);
        c1[i] = _mm512_add_ps(_mm512_loadu_ps(ci + 16), c1[i]);
      } else if (bias != nullptr) {
        const float* bi = bias + i * bs0;
        c0[i] = _mm512_add_ps(_mm512_loadu_ps(bi), c0[i]);
        c1[i] = _mm512_add_ps(_mm512_loadu_ps(bi + 16), c1[i]);
      }
      _mm512_storeu_ps(ci, c0[i]);
      _mm512_storeu_ps(ci + 16, c1[i]);
    }
    return;
  }
  alignas(64) float t[kMR * kNR];
#pragma GCC unroll 12
  for (int i = 0; i < kMR; ++i) {
    _mm512_store_ps(t + i * kNR, c0[i]);
    _mm512_store_ps(t + i * kNR + 16, c1[i]);
  }
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < nr; ++j) {
      float v = t[i * kNR + j];
      if (!first) {
        v = c[i * ldc + j] + v;
      } else if (bias != nullptr) {
        v = bias[i * bs0 + j * bs1] + v;
      }
      c[i * ldc + j] = v;
    }
  }
}

// Pack lines [0, n) x K block [pc, pc + kc) of an operand into panels of W lines:
// [panel][k][W], zero lines padding the last panel. Element (line p, k) is at
// src + p * sp + k * sk: A's rows (W = kMR, sp = its row stride, sk = its column stride) or
// B's columns (W = kNR, sp = its column stride, sk = its row stride).
template <int W>
inline void pack(const float* src, int64_t sp, int64_t sk, int n, int64_t pc, int64_t kc,
                 float* __restrict dst) {
  for (int p0 = 0; p0 < n; p0 += W) {
    int w = std::min(W, n - p0);
    const float* s = src + p0 * sp + pc * sk;
    float* d = dst + p0 * kc;
    for (int64_t k = 0; k < kc; ++k) {
      const float* line = s + k * sk;
      float* out = d + k * W;
      if (sp == 1) {
        std::memcpy(out, line, sizeof(float) * w);
      } else {
        for (int p = 0; p < w; ++p) out[p] = line[p * sp];
      }
      for (int p = w; p < W; ++p) out[p] = 0.f;
    }
  }
}

// The packing buffers of the calling thread (A panels, then B panels; 464 KiB), 64-byte
// aligned. Raises std::bad_alloc where they cannot be allocated.
inline float* workspace() {
  constexpr size_t kFloats = size_t(kMC + kMR) * kKC + size_t(kNB + kNR) * kKC;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buf(
      static_cast<float*>(std::aligned_alloc(64, kFloats * sizeof(float))));
  if (!buf) throw std::bad_alloc();
  return buf.get();
}

// How a product is cut into tasks: each matrix of the batch into row_groups x col_groups
// blocks (row groups a multiple of kMC rows), at least `threads` tasks where the product
// has enough row blocks. Fewer, larger tasks pack less: a task packs its B columns once per
// block of K and its A rows once per kNB columns.
struct Plan {
  int64_t batch, M, N, K, row_groups, col_groups, rows, cols;
  Plan(int64_t batch, int64_t M, int64_t N, int64_t K, int threads)
      : batch(batch), M(M), N(N), K(K) {
    int64_t row_blocks = (M + kMC - 1) / kMC;
    int64_t want = (threads + batch - 1) / batch;  // tasks per matrix
    row_groups = std::min(row_blocks, want);
    col_groups = std::min((N + kNR - 1) / kNR, (want + row_groups - 1) / row_groups);
    rows = (row_blocks + row_groups - 1) / row_groups * kMC;
    cols = ((N + kNR - 1) / kNR + col_groups - 1) / col_groups * kNR;
    row_groups = (M + rows - 1) / rows;
    col_groups = (N + cols - 1) / cols;
  }
  int64_t tasks() const { return batch * row_groups * col_groups; }
};

// Computes tasks [t0, t1) of `plan` on the calling thread: C[b] = bias[b] + A[b] @ B[b]
// (A: [batch, M, K], B: [batch, K, N], C: contiguous [batch, M, N], bias: broadcast to C's
// shape by its strides, or null). Needs AVX-512F (supported()); K >= 1.
inline void run_tasks(const Plan& plan, int64_t t0, int64_t t1, Operand a, Operand b,
                      Operand bias, float* c) {
  float* ap = workspace();
  float* bp = ap + size_t(kMC + kMR) * kKC;
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  const int64_t per = plan.row_groups * plan.col_groups;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t bi = t / per, rest = t % per;
    int64_t r0 = (rest / plan.col_groups) * plan.rows, c0 = (rest % plan.col_groups) * plan.cols;
    int64_t r1 = std::min(M, r0 + plan.rows), c1 = std::min(N, c0 + plan.cols);
    for (int64_t j0 = c0; j0 < c1; j0 += kNB) {
      int n = static_cast<int>(std::min<int64_t>(kNB, c1 - j0));
      for (int64_t pc = 0, kc; pc < K; pc += kc) {
        kc = k_block(K, pc);
        pack<kNR>(b.p + bi * b.sb + j0 * b.s1, b.s1, b.s0, n, pc, kc, bp);
        for (int64_t i0 = r0; i0 < r1; i0 += kMC) {
          int m = static_cast<int>(std::min<int64_t>(kMC, r1 - i0));
          pack<kMR>(a.p + bi * a.sb + i0 * a.s0, a.s0, a.s1, m, pc, kc, ap);
          const float* bias_t =
              bias.p ? bias.p + bi * bias.sb + i0 * bias.s0 + j0 * bias.s1 : nullptr;
          float* ct = c + bi * M * N + i0 * N + j0;
          for (int jr = 0; jr < n; jr += kNR) {
            for (int ir = 0; ir < m; ir += kMR) {
              micro(kc, ap + ir * kc, bp + jr * kc, ct + ir * N + jr, N, std::min(kMR, m - ir),
                    std::min(kNR, n - jr), pc == 0,
                    bias_t ? bias_t + ir * bias.s0 + jr * bias.s1 : nullptr, bias.s0, bias.s1);
            }
          }
        }
      }
    }
  }
}

// Whether this CPU runs the kernel (AVX-512F and FMA).
inline bool supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok;
}

// Whether the kernel runs by default here (ACCEL_CPU_MATMUL=auto): an AMD CPU whose cores
// execute AVX-512 at full width, family 0x1A (Zen 5) and later. There MKL's sgemm takes its
// generic AVX2 path at about half the kernel's speed; Zen 4 (family 0x19) runs AVX-512 on its
// 256-bit units, where that path is as fast (the kernel ran at 0.86-0.95x of it), and on
// Intel CPUs MKL's own AVX-512 kernels are faster (bench/README.md, thirtieth and sixty-sixth
// rounds). Family: CPUID leaf 1, base family plus extended family where the base is 0xF.
inline bool faster_than_eagers() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!supported() || !__builtin_cpu_is("amd") || !__get_cpuid(1, &a, &b, &c, &d)) return false;
    unsigned family = (a >> 8) & 0xF;
    if (family == 0xF) family += (a >> 20) & 0xFF;
    return family >= 0x1A;
  }();
  return ok;
}

}  // namespace accel_gemm
