#!/usr/bin/env bash
# Measure the two ways to load and launch a generated CUDA kernel (issue: keep the faster):
#   bash bench/cuda_load/run.sh     (on a machine with an NVIDIA GPU and nvcc)
set -euo pipefail
cd "$(dirname "$0")"
d=$(mktemp -d)
arch=${ACCEL_CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
[ "$arch" = 90 ] && arch=90a
nvcc -O3 -std=c++17 -arch=sm_$arch -shared -Xcompiler -fPIC kernel.cu -o "$d/k.so"
nvcc -O3 -std=c++17 -arch=sm_$arch -cubin kernel.cu -o "$d/k.cubin"
nvcc -O3 -std=c++17 main.cu -o "$d/main" -ldl
"$d/main" "$d/k.so" "$d/k.cubin"
rm -rf "$d"
