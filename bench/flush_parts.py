"""The host's µs for the parts of recording and flushing one small region: a five-call
region on a [4, 8] tensor (``tanh(softmax(x * 0.125) + 1) * 2``), eager and accel loops
(the region then a flushing matmul), then, on the region recorded once: the liveness
mask, the kernel look-up, gathering the kernel's addresses and launching it (through
``accel.launch``, as ``accel.runtime.execute`` does; on a GPU the current stream's look-up
also timed apart), recording the five calls then resetting the region (its outputs
freed), then launching its kernel before the reset, then flushing through the native
core's ``run_cached``, then through the interceptor's flush, and ``torch.empty_strided``
from Python for scale. Best of three loops of 2000 (the GPU synchronized before and after
each loop).

    python bench/flush_parts.py [cpu|cuda]
"""
from __future__ import annotations

import sys
import time

import _common  # puts this checkout's accel first on sys.path
_common.intercept_every_step()  # it times interception itself
import torch

import accel
from accel import dispatch, interceptor, launch, runtime


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dev = argv[0] if argv else ("cuda" if torch.cuda.is_available() else "cpu")
    x, w = torch.randn(4, 8, device=dev), torch.randn(8, 8, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    dispatch.wait()

    def body():
        return torch.tanh(torch.softmax(x * 0.125, -1) + 1) * 2

    def timeit(fn, n=2000):
        best = float("inf")
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    def accel_loop():
        with accel.eager():
            for _ in range(100):
                body() @ w

    accel_loop()
    rows = [("eager: region's calls + matmul", timeit(lambda: body() @ w)),
            ("accel: region's calls + matmul", timeit(accel_loop, 20) / 100)]
    with accel.eager():
        y = body()  # held, as the matmul holds it: the mask the loop's kernel was built for
        r = interceptor._state.region
        live = r.liveness()
        kern = r.node.kernels.get(live)
        ptrs = launch.kernel_ptrs(kern, r, r.ext, r.outs)
        rows += [("liveness mask", timeit(r.liveness)),
                 ("kernel look-up", timeit(lambda: r.node.kernels.get(live))),
                 ("kernel addresses", timeit(lambda: launch.kernel_ptrs(kern, r, r.ext, r.outs)))]
        if dev == "cuda":
            rows += [("current stream", timeit(lambda: launch.raw_stream(0))),
                     ("launch (the stream's look-up included)",
                      timeit(lambda: launch.launch_kernel(kern, r, ptrs, r.scalars)))]
        else:
            rows.append(("launch (runs the kernel)", timeit(lambda: launch.launch_kernel(kern, r, ptrs, r.scalars))))
        interceptor.flush()
        del y

        def record_flush():
            y = body()
            interceptor.flush()
            return y

        def record_reset():
            y = body()
            r.reset()
            return y

        def record_launch_reset():
            y = body()
            launch.launch_kernel(kern, r, launch.kernel_ptrs(kern, r, r.ext, r.outs), r.scalars)
            r.reset()
            return y

        def record_run_cached():
            y = body()
            assert r.run_cached(runtime.STATS, runtime.CompiledRegion, launch._ahead_min, False)
            return y

        rows += [("record 5 calls, reset", timeit(record_reset)),
                 ("record 5 calls, launch, reset", timeit(record_launch_reset)),
                 ("record 5 calls, run_cached", timeit(record_run_cached)),
                 ("record 5 calls, flush", timeit(record_flush))]
    rows.append(("torch.empty_strided from Python", timeit(lambda: torch.empty_strided((4, 8), (8, 1), device=dev))))
    print(f"| part ({dev}) | µs |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
