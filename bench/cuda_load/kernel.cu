// The kernel both load paths run: y = 2x + 1 over n floats (a grid-stride loop).
#include <cuda_runtime.h>
extern "C" __global__ void scale(const float* x, float* y, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    y[i] = 2.0f * x[i] + 1.0f;
}
// Host launcher, as accel's generated CUDA modules have one: set the device, launch on the
// caller's stream, return the launch status.
extern "C" int launch(void* const* bufs, long n, void* stream, int device) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  scale<<<(int)((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535), 256, 0, (cudaStream_t)stream>>>(
      (const float*)bufs[0], (float*)bufs[1], n);
  return (int)cudaGetLastError();
}
