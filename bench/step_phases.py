"""The demo's GPT-2 training step split into its forward (to the loss) and its backward,
each synchronized, for eager, accel, and accel with nothing recorded on autograd's device
thread (a CUDA backward's calls then run eagerly there, through the interceptor's own
path); steps timed round-robin after 40 untimed rounds. ``--all-eager``: every region of
the accel variants runs its calls eagerly (the small-region rule of
``accel.interceptor`` applied to regions of any size: after the untimed rounds nothing is
recorded), which leaves the cost of intercepting the step's calls alone.
``--nothing-deferred``: the dispatch filter is told that no op is deferrable, so it runs
every call past the mode in C++ (the mode on the stack, nothing deferred or decided).
A last variant includes the dispatch filter's key with no dispatch mode on the stack:
every call passes the filter's kernel and goes on untouched, the least an interceptor in
front of the dispatcher costs (what a design without the Python-level mode could reach).
``--other-thread``: every variant's backward runs on one other, persistent thread that
inherits the calling thread's dispatch modes and filter key, as autograd's CUDA device
thread does; on the CPU, whose backward otherwise runs on the calling thread, accel then
takes its device-thread path (``accel.interceptor._Worker``), measurable and profilable
without a GPU.

    python bench/step_phases.py [cpu|cuda] [--tiny] [--all-eager | --nothing-deferred]
                                [--other-thread] [--steps 40]

Prints median ms per phase and per step, then the calls of one accel step as the dispatch
filter counted them on the calling thread (run past the mode, passed on, recorded, small
regions' first calls run eagerly) and recorded on every thread.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import queue
import statistics
import threading
import time

import _common  # puts this checkout's accel first on sys.path
_common.intercept_every_step()  # it times interception itself
import torch

import accel
from accel import dispatch, eager_regions, interceptor


@contextlib.contextmanager
def _backward_not_recorded():
    """accel.eager(), with autograd's device thread left unrecorded: its worker cannot queue
    the final callback it needs, so every call there runs eagerly (see ``_Worker``)."""
    queue = interceptor._Worker.queue_final_callback
    interceptor._Worker.queue_final_callback = lambda self: False
    try:
        with accel.eager():
            yield
    finally:
        interceptor._Worker.queue_final_callback = queue


@contextlib.contextmanager
def _filter_key_alone():
    """The dispatch filter's key included on this thread (autograd's device thread inherits
    it), no dispatch mode pushed: each call takes the filter's kernel, which passes it on."""
    was = dispatch.set_included(True)
    try:
        yield
    finally:
        dispatch.set_included(was)


class _OtherThread:
    """One persistent thread that runs a function for the calling thread with the calling
    thread's dispatch modes pushed and the filter's key as included there: what autograd's
    CUDA device thread inherits from the graph task's thread-local state."""

    def __init__(self):
        self.jobs, self.done = queue.SimpleQueue(), queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            fn, modes, included = self.jobs.get()
            for m in modes:
                m.__enter__()
            was = dispatch.set_included(included) if dispatch.loaded() else False
            try:
                fn()
                self.done.put(None)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                self.done.put(e)
            finally:
                if dispatch.loaded():
                    dispatch.set_included(was)
                for m in reversed(modes):
                    m.__exit__(None, None, None)

    def run(self, fn) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        included = False
        if dispatch.loaded():  # read by setting it, then put back
            included = dispatch.set_included(True)
            dispatch.set_included(included)
        self.jobs.put((fn, _get_current_dispatch_mode_stack(), included))
        err = self.done.get()
        if err is not None:
            raise err


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a host-bound GPT-2 (32 channels, 8 tokens)")
    layer = p.add_mutually_exclusive_group()
    layer.add_argument("--all-eager", action="store_true", help="every region runs its calls eagerly")
    layer.add_argument("--nothing-deferred", action="store_true",
                   help="the filter runs every call past the mode (no op deferrable)")
    p.add_argument("--other-thread", action="store_true",
                   help="each backward on another thread, as on autograd's CUDA device thread")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base, ids, labels = _common.gpt2(dev, args.tiny)
    dispatch.wait()
    if args.all_eager:
        eager_regions.SMALL_REGION_CALLS = 1 << 30
        eager_regions.SMALL_REGION_BYTES = dict.fromkeys(eager_regions.SMALL_REGION_BYTES, 1 << 62)
    if args.nothing_deferred and dispatch.loaded():
        dispatch.set_deferrable([])
    variants = {"eager": contextlib.nullcontext, "accel": accel.eager,
                "accel, backward not recorded": _backward_not_recorded}
    if dispatch.loaded():
        variants["filter key alone, no mode"] = _filter_key_alone
    models = {k: copy.deepcopy(base) for k in variants}
    backward = _OtherThread().run if args.other_thread else (lambda fn: fn())

    def step(name):
        m = models[name]
        m.zero_grad(set_to_none=True)
        with variants[name]():
            t0 = time.perf_counter()
            loss = m(input_ids=ids, labels=labels).loss
            sync()
            t1 = time.perf_counter()
            backward(loss.backward)
            sync()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(40):  # kernels built or loaded, small regions decided, allocator warm
        for k in variants:
            step(k)
    times = {k: [] for k in variants}
    for _ in range(args.steps):
        for k in variants:
            times[k].append(step(k))
    print(f"GPT-2 train step{' (--tiny)' if args.tiny else ''}, {dev}, "
          f"{'backward on another thread, ' if args.other_thread else ''}"
          f"{'nothing deferred, ' if args.nothing_deferred else ''}"
          f"{'every region eager, ' if args.all_eager else ''}medians of {args.steps} interleaved "
          f"steps, torch {torch.__version__}\n")
    print("| variant | forward ms | backward ms | step ms | eager / variant |")
    print("|---|---|---|---|---|")
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731
    e = med([f + b for f, b in times["eager"]])
    for k, ts in times.items():
        whole = med([f + b for f, b in ts])
        print(f"| {k} | {med([f for f, _ in ts]):.3f} | {med([b for _, b in ts]):.3f} | "
              f"{whole:.3f} | {e / whole:.2f}x |")
    if dispatch.loaded():
        r0, c0 = dispatch.recorded(), dispatch.counts()
        step("accel")
        past, on, rec, small = (b - a for a, b in zip(c0, dispatch.counts()))
        print(f"\nOne accel step, the calling thread: {past} calls run past the mode, {on} passed "
              f"on, {rec} recorded, {small} small regions' first calls run eagerly; recorded on "
              f"every thread: {dispatch.recorded() - r0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
