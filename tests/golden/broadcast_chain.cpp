#include "accel/cpu_math.h"

extern "C" int accel_region_golden(void* const* bufs, const accel_scalar_t* s) {
  const float* b0 = (const float*)bufs[0];
  const float* b1 = (const float*)bufs[1];
  float* __restrict__ b2 = (float*)bufs[2];
  const float s0_0 = static_cast<float>(s[0].f);
  {
    #pragma omp parallel for schedule(static)
    for (int64_t i0 = 0; i0 < 64; ++i0) {
      #pragma omp simd
      for (int64_t i1 = 0; i1 < 1000; ++i1) {
        const float t1 = b0[1000 * i0 + i1];
        const float t2 = b1[i1];
        const float t3 = (t1 + t2);
        const float t4 = (t3 * s0_0);
        const float t5 = accel::tanh(t4);
        b2[1000 * i0 + i1] = t5;
      }
    }
  }
  return ACCEL_OK;
}
