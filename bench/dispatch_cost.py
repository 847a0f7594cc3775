"""What interception costs in the demo's GPT-2 training step: eager, a no-op
``TorchDispatchMode`` (every call crosses into Python and is re-dispatched), accel with its
dispatch filter (accel/dispatch.py), the same with the filter's unboxed kernels removed
(every call boxed by its fallback, as before they were added: in alternate blocks of
steps), and accel with the filter's key left out (every call crosses into the mode, as
before the filter). Steps are timed interleaved (round-robin,
fair under a changing machine load), synchronized on a GPU; each variant trains its own
copy of the model.

    python bench/dispatch_cost.py [--device cpu|cuda] [--steps 30] [--threads N] [--tiny]

``--tiny``: host_parts.py's host-bound GPT-2 (32 channels, a batch of one 8-token
sequence, one thread), a proxy for the GPU's host cost on a machine without one.

Prints a markdown table: median and lower-quartile ms per step, and each variant against
eager.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import _common  # puts this checkout's accel first on sys.path
_common.intercept_every_step()  # it times interception itself
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accel
from accel import dispatch
from accel.demo import train_step


class NoOpMode(TorchDispatchMode):
    """Re-dispatches every call unchanged: the cost of the Python crossing alone."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **(kwargs or {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="a host-bound GPT-2 (32 channels, 8 tokens)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base, ids, labels = _common.gpt2(dev, args.tiny)
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
    boxed = "accel, boxed fallback only"
    times = {k: [] for k in [*fns, boxed]}
    # the filter's unboxed kernels are removed for every other block of rounds (toggling
    # them re-registers kernels, which perturbs the steps right after it: not per step)
    block = max(1, args.steps // 6)
    for i in range(args.steps):
        unboxed = not loaded or (i // block) % 2 == 0
        if loaded and i % block == 0:
            dispatch.set_unboxed(unboxed)  # between steps: no other thread makes calls
            with_filter(); with_filter()
            sync()
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[k if fn is not with_filter or unboxed else boxed].append((time.perf_counter() - t0) * 1e3)
    if loaded:
        dispatch.set_unboxed(True)
    times = {k: v for k, v in times.items() if v}
    e = statistics.median(times["eager"])
    print(f"GPT-2 train step (accel demo{', --tiny' if args.tiny else ''}), {dev}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, dispatch filter loaded: {loaded} ({dispatch.unboxed()} ops with unboxed kernels), "
          f"{args.steps} interleaved steps\n")
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
