"""The demo's GPT-2 training step under step sampling (accel/sampling.py): eager, accel
intercepting every step (``ACCEL_STEP_SAMPLING=off``), and accel with sampling on, each
with a model copy of its own, timed round-robin (each step synchronized on a GPU)
after ``--warmup`` untimed rounds, long enough for sampling's first decision. Prints the
median ms a step, eager's speed over each, and how many of the timed steps accel as
shipped ran without interception.

The two accel variants share the thread: the switch that accel reads from the variable at
an enable is set before each step (setting the variable itself would make every enable
apply the whole configuration again), and the sampler counts only the steps taken with
it on.

    python bench/step_sampling.py [cpu|cuda] [--tiny] [--warmup 40] [--steps 60]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import _common  # puts this checkout's accel first on sys.path
import torch

import accel
from accel import demo, interceptor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("device", nargs="?", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tiny", action="store_true", help="the host-bound GPT-2 of _common.gpt2")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base, ids, labels = _common.gpt2(dev, args.tiny)
    models = {k: copy.deepcopy(base) for k in ("eager", "every step", "sampled")}

    def run(name):
        m = models[name]
        if name == "eager":
            demo.train_step(m, ids, labels)
        else:
            interceptor._sampling = name == "sampled"  # (what enable reads from the variable)
            with accel.eager():
                demo.train_step(m, ids, labels)
        sync()

    times = {k: [] for k in models}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            before = accel.stats()["bypassed_steps"]
        for name in models:
            t0 = time.perf_counter()
            run(name)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        if i == 0:
            accel.dispatch.wait()  # (its build began at the first enable; steady state has it)
    bypassed = accel.stats()["bypassed_steps"] - before
    for name in ("every step", "sampled"):
        for (n, pe), pa in zip(models["eager"].named_parameters(), models[name].parameters()):
            torch.testing.assert_close(pa.grad, pe.grad, msg=f"{name}: {n}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"GPT-2 train step{' (--tiny)' if args.tiny else ''}, {dev.type}"
          f"{' ' + torch.cuda.get_device_name() if dev.type == 'cuda' else ''}, torch "
          f"{torch.__version__}: medians of {args.steps} interleaved steps after {args.warmup}\n")
    print("| variant | step ms | eager / variant |\n|---|---|---|")
    for k in models:
        label = {"eager": "eager", "every step": "accel, every step intercepted",
                 "sampled": "accel, step sampling on"}[k]
        print(f"| {label} | {med[k]:.3f} | {med['eager'] / med[k]:.2f}x |")
    print(f"\nTimed steps accel (sampled) ran without interception: {bypassed} of {args.steps}; "
          "gradients as eager's in both variants.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
