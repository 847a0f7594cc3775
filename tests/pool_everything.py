"""pytest plugin (``-p pool_everything``, with ``tests/`` on the path): every CPU output of a
region comes from accel's output pool, its size threshold lowered to one byte. The pure-Python
core (``ACCEL_PURE_PYTHON=1``) asks the pool for every output; the Cython core keeps its
threshold compiled in. tests/test_allocator.py runs suites under it."""
import os

import accel.allocator

accel.allocator.MIN_BLOCK = 1
os.environ["ACCEL_CPU_POOL"] = "on"  # auto: off where the heap reuses freed memory
