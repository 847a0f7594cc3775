"""pytest plugin (``-p stream_everything``, with ``tests/`` on the path): every store the CPU
codegen may stream (contiguous along the innermost loop of cheap ops, to a buffer the kernel
does not read) is streamed, whatever its size. tests/test_pipeline.py runs suites under it."""
import accel.codegen.cpp

accel.codegen.cpp.STREAM_MIN_BYTES = 1
