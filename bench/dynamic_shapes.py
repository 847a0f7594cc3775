"""Shapes that keep changing: an MLP block, LayerNorm(x + fc2(GELU(fc1(x)))), trained with
SGD (momentum 0.9), one step per row count, over distinct row counts (a sequence length per
batch), on a CPU or a GPU.

Each variant runs in a fresh process with a fresh accel store and Inductor cache:
eager; accel as shipped (shape-generic kernels, ``ACCEL_RECOMPILE_LIMIT`` at its default);
accel with every region built for its own sizes (``ACCEL_GENERIC_KERNELS=0``); both again
without a recompile limit; torch.compile of the block (its default: after a recompile for
a new shape, a kernel generic in that dim), the optimizer eager. Step sampling is off
(every step intercepted: the kernels are what is measured).

Prints per variant: two passes over the row counts (s; on a GPU a region is built when
met again, its first call run eagerly while the GPU is idle, so the second pass builds
too), kernels built (and, after a "+", any built in the timed pass) and regions served by
a shared kernel, regions run eagerly in those passes (past the limit, or first met), a third
pass (median ms a step, nothing left to build), and whether the final parameters match
eager's (``torch.testing.assert_close`` defaults).

    python bench/dynamic_shapes.py [cpu|cuda] [--lengths N] [--no-compile] [--only accel,...]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "eager": {},
    "accel": {},
    "accel static kernels": {"ACCEL_GENERIC_KERNELS": "0"},
    "accel no limit": {"ACCEL_RECOMPILE_LIMIT": "0"},
    "accel static kernels no limit": {"ACCEL_GENERIC_KERNELS": "0",
                                      "ACCEL_RECOMPILE_LIMIT": "0"},
    "torch.compile": {},
}
WARM_PASSES = 2


def _child(variant: str, device: str, n: int, out: str) -> None:
    import torch

    import accel

    channels, base = (1024, 2048) if device == "cuda" else (256, 256)
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(channels, 4 * channels)
            self.fc2 = torch.nn.Linear(4 * channels, channels)
            self.ln = torch.nn.LayerNorm(channels)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.fc1(x), approximate="tanh")
            return self.ln(x + self.fc2(h))

    model = Block().to(device)
    # (SGD, not AdamW: Adam's first updates are lr * sign(grad), so a gradient near 0 whose
    # rounding differs between backends moves its parameter by 2 lr: no parameter comparison)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    fwd = torch.compile(model) if variant == "torch.compile" else model
    lengths = random.Random(0).sample(range(base // 2, 2 * base), n)
    batches = [torch.randn(r, channels, generator=torch.Generator().manual_seed(r)).to(device)
               for r in lengths]

    def step(x):
        loss = fwd(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def run(x):
        if variant.startswith("accel"):
            with accel.eager():
                step(x)
        else:
            step(x)
        if device == "cuda":
            torch.cuda.synchronize()

    accel.reset_stats()
    t0 = time.perf_counter()
    for _ in range(WARM_PASSES):
        for x in batches:
            run(x)
    first = time.perf_counter() - t0
    st = accel.stats()
    times = []
    for x in batches:
        t0 = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t0)
    end = accel.stats()
    if os.environ.get("DYN_SHAPES_DEBUG"):
        print(variant, [round(t * 1e3, 1) for t in times], end, file=sys.stderr)
    torch.save([p.detach().cpu() for p in model.parameters()], out + ".pt")
    with open(out, "w") as f:
        json.dump({"first_s": first, "steady_ms": statistics.median(times) * 1e3,
                   "builds": st["compiles"] - st["generic_hits"],
                   "late_builds": (end["compiles"] - end["generic_hits"]
                                   - st["compiles"] + st["generic_hits"]),
                   "generic_hits": st["generic_hits"], "eager_replays": st["eager_replays"]}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--lengths", type=int, default=20, help="row counts (steps a pass)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--only", default="",
                    help="variants to run, comma-separated (eager always runs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.device, args.lengths, args.out)
        return
    import torch

    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, env) in enumerate(VARIANTS.items()):
            if (name == "torch.compile" and args.no_compile) or (
                    args.only and name != "eager" and name not in args.only.split(",")):
                continue
            out = os.path.join(tmp, f"v{k}.json")
            child_env = {**os.environ, "ACCEL_CACHE_DIR": os.path.join(tmp, f"store{k}"),
                         "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"inductor{k}"),
                         "ACCEL_STEP_SAMPLING": "off", **env}
            cmd = [sys.executable, __file__, args.device, "--lengths", str(args.lengths),
                   "--child", name, "--out", out]
            r = subprocess.run(cmd, env=child_env, capture_output=True, text=True)
            if r.returncode != 0:
                rows.append(f"| {name} | failed: {r.stderr.strip().splitlines()[-1][:200]} |")
                continue
            with open(out) as f:
                res = json.load(f)
            params = torch.load(out + ".pt")
            if ref is None:
                ref, match = params, "-"
            else:
                try:
                    for a, b in zip(params, ref):
                        torch.testing.assert_close(a, b)
                    match = "yes"
                except AssertionError as e:
                    match = "MISMATCH: " + str(e).strip().splitlines()[0][:80]
            late = f" + {res['late_builds']}" if res["late_builds"] else ""
            accel_cells = (f"{res['builds']}{late} | {res['generic_hits']} | {res['eager_replays']}"
                           if name.startswith("accel") else "- | - | -")
            rows.append(f"| {name} | {res['first_s']:.2f} | {accel_cells} | "
                        f"{res['steady_ms']:.3f} | {match} |")
            print(rows[-1], file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} cores"
    print(f"MLP block + SGD over {args.lengths} row counts, {args.device} ({where}), "
          f"torch {torch.__version__}\n")
    print(f"| variant | {WARM_PASSES} passes (s) | kernels built | served by a shared "
          "kernel | eager replays | steady pass (ms a step) | parameters match eager's |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
