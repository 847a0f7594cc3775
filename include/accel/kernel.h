/* accel kernel ABI: one C entry point per compiled CPU region.
 *
 *   int <name>(void* const* bufs, const accel_scalar_t* scalars);
 *
 * bufs: the region's external inputs, then its live outputs, then its scratch buffers
 * (data pointers, storage offset applied); scalars: the runtime scalar arguments in call
 * order. Returns 0, or a nonzero status after which the caller runs the region eagerly.
 */
#ifndef ACCEL_KERNEL_H
#define ACCEL_KERNEL_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef union accel_scalar {
  double f;
  int64_t i;
} accel_scalar_t;

typedef int (*accel_kernel_fn)(void* const* bufs, const accel_scalar_t* scalars);

/* CUDA regions are cubins, not entry points: each kernel takes the same two arrays by
 * value, ``accel_bufs<N>`` and ``accel_scalars<M>`` (accel/cuda_math.cuh), and the core
 * launches them through the driver API by the plan stored with the region. */

#define ACCEL_OK 0
#define ACCEL_ERROR 1

#ifdef __cplusplus
}
#endif
#endif /* ACCEL_KERNEL_H */
