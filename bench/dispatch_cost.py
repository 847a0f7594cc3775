"""What interception costs in the demo's GPT-2 training step: eager, a no-op
``TorchDispatchMode`` (every call crosses into Python and is re-dispatched), accel with its
dispatch filter (accel/dispatch.py), and accel with the filter's key left out (every call
crosses into the mode, as before the filter). Steps are timed interleaved (round-robin,
fair under a changing machine load), synchronized on a GPU; each variant trains its own
copy of the model.

    python bench/dispatch_cost.py [--device cpu|cuda] [--steps 30] [--threads N]

Prints a markdown table: median and lower-quartile ms per step, and each variant against
eager.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import _common  # noqa: F401 - puts this checkout's accel first on sys.path
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accel
from accel import dispatch
from accel.demo import build_model, make_batch, train_step


class NoOpMode(TorchDispatchMode):
    """Re-dispatches every call unchanged: the cost of the Python crossing alone."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **(kwargs or {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base = build_model().to(dev)
    ids, labels = (t.to(dev) for t in make_batch())
    models = [copy.deepcopy(base) for _ in range(4)]
    loaded = dispatch.wait()

    def eager():
        train_step(models[0], ids, labels)

    def noop():
        with NoOpMode():
            train_step(models[1], ids, labels)

    def with_filter():
        with accel.eager():
            train_step(models[2], ids, labels)

    def without_filter():
        with accel.eager():
            if dispatch.loaded():
                dispatch.set_included(False)  # for this context (its exit leaves it out too)
            train_step(models[3], ids, labels)

    fns = {"eager": eager, "no-op TorchDispatchMode": noop, "accel": with_filter,
           "accel, filter off": without_filter}
    for fn in fns.values():  # warm up: kernels built or loaded, allocator warm
        fn(); fn()
    sync()
    times = {k: [] for k in fns}
    for _ in range(args.steps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append((time.perf_counter() - t0) * 1e3)
    e = statistics.median(times["eager"])
    print(f"GPT-2 train step (accel demo), {dev}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, dispatch filter loaded: {loaded}, {args.steps} interleaved steps\n")
    print("| variant | median ms | lower quartile ms | eager / variant |")
    print("|---|---|---|---|")
    for k, ts in times.items():
        ts.sort()
        med = statistics.median(ts)
        print(f"| {k} | {med:.2f} | {ts[len(ts) // 4]:.2f} | {e / med:.2f}x |")
    if loaded:
        r0, c0 = dispatch.recorded(), dispatch.counts()
        with_filter()
        sync()
        c1 = dispatch.counts()
        past, on, rec, small = (b - a for a, b in zip(c0, c1))
        print(f"\nOne accel step, the filter on the calling thread: {past} calls run past the mode, "
              f"{on} passed on to it or to the filter's recording, {rec} recorded by the filter, "
              f"{small} small regions' first calls run eagerly; "
              f"recorded on every thread (autograd's device thread included): "
              f"{dispatch.recorded() - r0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
