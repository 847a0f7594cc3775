// The part of a thread's pending region that accel's dispatch filter reads (and extends,
// when it records a call itself): kept by the region core (accel/_core.pyx) alongside its
// Python lists, read by include/accel/dispatch_filter.cpp.
//
// A region whose `replay` byte is 0 is only ever read at offset 0 (`pending`): the
// pure-Python core binds a zeroed 16-byte buffer in its place.
#ifndef ACCEL_REGION_VIEW_H
#define ACCEL_REGION_VIEW_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Mirrored external inputs and outputs per region; past it the filter leaves the region's
// calls to the interceptor.
#define ACCEL_VIEW_MAX 512

typedef struct accel_region_view {
  volatile uint8_t pending;  // 1 while the region has recorded calls
  uint8_t replay;            // the filter may record calls into it: 1 through the core's
                             // _replay (its owner thread), 2 through `replay_fn` (autograd's
                             // device thread, whose region is shared with a final callback)
  uint8_t busy;              // flushing or evaluating a call: calls pass through
  int32_t n_calls;           // recorded calls
  int32_t cap;               // the interceptor flushes a region of this many calls
  int32_t n_ext, n_out;      // external inputs, outputs (entries below ACCEL_VIEW_MAX valid)
  void* node;                // PyObject*: the region's trie node (borrowed)
  void* region;              // PyObject*: the region core itself (borrowed)
  void* replay_fn;           // PyObject*: where replay is 2, _replay's stand-in (borrowed)
  intptr_t lo, hi;           // addresses spanned by the outputs' storage
  void* ext[ACCEL_VIEW_MAX];            // TensorImpl* of each external input
  void* out[ACCEL_VIEW_MAX];            // TensorImpl* of each output
  intptr_t out_base[ACCEL_VIEW_MAX];    // data address of each output
} accel_region_view;

// The storages whose memory is shared outside torch's dispatcher (a NumPy array's, a
// DLPack consumer's or producer's, a buffer's, shared memory's: accel/shared.py), which no
// region may read or write: code there sees the memory at any time, not at a flush. Kept
// by the region core; `n` StorageImpl* in `storage`, or -1 where there are more than
// ACCEL_SHARED_MAX (the core then asks accel/shared.py, and the filter leaves every
// external input to the interceptor). Written by the interceptor under the GIL, with `n`
// at -1 while the entries change.
#define ACCEL_SHARED_MAX 64

typedef struct accel_shared_set {
  volatile int32_t n;
  void* storage[ACCEL_SHARED_MAX];
} accel_shared_set;

#ifdef __cplusplus
}
#endif

#endif  // ACCEL_REGION_VIEW_H
