"""Cold start of the demo's GPT-2 training step with a fresh store: building the kernels at
each flush (the default) or in the background (``ACCEL_ASYNC_COMPILE=1``, the regions run
eagerly until their kernels are ready). Prints one JSON line per mode, each measured in a
new process.

    python bench/cold_start.py [cpu|cuda]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def child(dev: str) -> dict:
    import torch

    import accel
    from accel.demo import build_model, make_batch, train_step

    model = build_model().to(dev)
    ids, labels = (t.to(dev) for t in make_batch())

    def step():
        with accel.eager():
            loss = train_step(model, ids, labels)
        if dev == "cuda":
            torch.cuda.synchronize()
        return loss

    train_step(model, ids, labels)  # eager's own first-call costs (libraries, allocator)
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    accel.wait_for_compiles()
    ready = time.perf_counter() - t0
    step()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    st = accel.stats()
    return {"first call s": round(first, 2), "all kernels ready s": round(ready, 2),
            "steady ms": round(sorted(ts)[2] * 1e3, 1), "regions compiled": st["compiles"],
            "compile s (summed)": round(st["compile_time_s"], 2)}


def main() -> int:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if os.environ.get("_ACCEL_COLD_CHILD"):
        print(json.dumps(child(dev)))
        return 0
    for mode in ("0", "1"):
        env = dict(os.environ, _ACCEL_COLD_CHILD="1", ACCEL_ASYNC_COMPILE=mode,
                   ACCEL_CACHE_DIR=os.path.join(tempfile.mkdtemp(prefix="accel-cold-"), "store"))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), dev], env=env,
                             capture_output=True, text=True, timeout=900)
        line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]
        print(f"ACCEL_ASYNC_COMPILE={mode} ({dev}): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
