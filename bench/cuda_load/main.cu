// Load-and-launch paths for a generated CUDA kernel: (a) a host shared library (dlopen,
// dlsym, its launcher calls <<<>>> through the CUDA runtime), (b) a cubin through the driver
// API (cuModuleLoad, cuModuleGetFunction, cuLaunchKernel). Prints the load time of each and
// the host time per launch (10000 launches, one synchronization at the end). The driver API
// is taken from libcuda.so.1 at run time (dlopen), as a Cython core would.
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <chrono>
#include <cstdio>
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}
int main(int argc, char** argv) {
  void* drv = dlopen("libcuda.so.1", RTLD_NOW);
  if (!drv) { printf("no libcuda.so.1\n"); return 1; }
  auto cuModuleLoad_ = (CUresult (*)(CUmodule*, const char*))dlsym(drv, "cuModuleLoad");
  auto cuModuleGetFunction_ = (CUresult (*)(CUfunction*, CUmodule, const char*))dlsym(drv, "cuModuleGetFunction");
  auto cuLaunchKernel_ = (CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                       unsigned, unsigned, CUstream, void**, void**))dlsym(drv, "cuLaunchKernel");
  const long n = 4096;  // small: the host cost of a launch, not the kernel, sets the pace
  const int iters = 10000;
  float *x, *y;
  cudaFree(0);  // the primary context, as torch has made it already
  cudaMalloc(&x, n * 4);
  cudaMalloc(&y, n * 4);
  cudaStream_t st;
  cudaStreamCreate(&st);
  void* bufs[2] = {x, y};
  auto t0 = clk::now();
  void* so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  auto fn = (int (*)(void* const*, long, void*, int))dlsym(so, "launch");
  auto t1 = clk::now();
  if (!fn || fn(bufs, n, st, 0) != 0) { printf("shared library path failed\n"); return 1; }
  cudaStreamSynchronize(st);
  auto t2 = clk::now();
  CUmodule mod;
  CUfunction k;
  if (cuModuleLoad_(&mod, argv[2]) != CUDA_SUCCESS || cuModuleGetFunction_(&k, mod, "scale") != CUDA_SUCCESS) {
    printf("cubin path failed\n");
    return 1;
  }
  auto t3 = clk::now();
  long nn = n;
  void* args[3] = {&x, &y, &nn};
  unsigned grid = (unsigned)((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535);
  cuLaunchKernel_(k, grid, 1, 1, 256, 1, 1, 0, st, args, nullptr);
  cudaStreamSynchronize(st);
  auto t4 = clk::now();
  printf("load: shared library %.1f us (dlopen + dlsym), first launch + sync %.1f us\n", us(t0, t1), us(t1, t2));
  printf("load: cubin %.1f us (cuModuleLoad + cuModuleGetFunction), first launch + sync %.1f us\n", us(t2, t3), us(t3, t4));
  for (int rep = 0; rep < 3; ++rep) {
    auto a = clk::now();
    for (int i = 0; i < iters; ++i) fn(bufs, n, st, 0);
    auto b = clk::now();
    cudaStreamSynchronize(st);
    auto c = clk::now();
    for (int i = 0; i < iters; ++i) cuLaunchKernel_(k, grid, 1, 1, 256, 1, 1, 0, st, args, nullptr);
    auto d = clk::now();
    cudaStreamSynchronize(st);
    printf("launch (host us per call): shared-library launcher %.2f, cuLaunchKernel %.2f\n",
           us(a, b) / iters, us(c, d) / iters);
  }
  return 0;
}
