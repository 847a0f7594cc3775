"""The accel demo: one GPT-2 training iteration, plain eager PyTorch vs ``accel.eager()``.

Builds a small Hugging Face ``GPT2LMHeadModel`` with random weights (``torch.manual_seed(0)``,
no download, dropout off so runs are deterministic) and two identical copies of it. Each
copy runs forward + backward (``model(input_ids, labels=labels).loss.backward()``) on the
same fixed batch: one in plain eager PyTorch, one under ``with accel.eager():``. The demo
checks that the losses and every parameter gradient match (``torch.testing.assert_close``
defaults), then reports the median time per iteration of each, the speedup, and accel's
counters (regions flushed, kernels run, eager replays, store hits, compiles).

Run it with ``python -m accel.demo`` or ``accel demo``; exit status 0 = PASS, 1 = mismatch,
2 = transformers missing. A second run in a new process finds every kernel in the on-disk
store ($ACCEL_CACHE_DIR) and compiles nothing.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import time

import torch

import accel

log = logging.getLogger("accel.demo")

__all__ = ["DEFAULTS", "main", "build_model", "make_batch", "train_step", "time_steps"]


#: the demo's model and batch size: a GPT-2 small enough for a 2-core CPU (1.9M parameters),
#: big enough that its elementwise work, not per-op overhead, is what accel changes
DEFAULTS = {"layers": 2, "embd": 256, "heads": 4, "seq": 128, "batch": 8}


def build_model(layers: int = DEFAULTS["layers"], embd: int = DEFAULTS["embd"],
                heads: int = DEFAULTS["heads"], seq: int = DEFAULTS["seq"], vocab: int = 1000):
    """A small GPT2LMHeadModel with random weights (seed 0) and no dropout, in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=max(seq, 128), n_embd=embd, n_layer=layers,
                     n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # transformers warns when it has to guess
    model.train()  # dropout p=0: deterministic; train() keeps the training code paths
    return model


def make_batch(batch: int = DEFAULTS["batch"], seq: int = DEFAULTS["seq"], vocab: int = 1000):
    """Fixed random (input_ids, labels) of shape [batch, seq]."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return input_ids, labels


def train_step(model, input_ids, labels) -> torch.Tensor:
    """One forward + backward; gradients are reset first, so they hold this step's only."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def time_steps(fns, steps: int) -> list:
    """Call each of ``fns`` once to warm up, then ``steps`` rounds of each in turn
    (interleaved, so a changing machine load hits all alike); the seconds, per fn."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(steps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return times


def _accel_step(model, input_ids, labels):
    with accel.eager():  # leaving the block flushes: the step is complete when this returns
        return train_step(model, input_ids, labels)


def _compare(eager_model, accel_model, loss_e, loss_a) -> list:
    """Mismatch messages (empty if the losses and all parameter gradients match)."""
    pairs = [("loss", loss_a, loss_e)]
    pa = dict(accel_model.named_parameters())
    pairs += [(n, pa[n].grad, p.grad) for n, p in eager_model.named_parameters()]
    bad = []
    for name, a, e in pairs:
        try:
            torch.testing.assert_close(a, e)  # a None grad only matches None
        except (AssertionError, TypeError) as err:
            bad.append(f"{name}: {err}")
    return bad


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed iterations (after 1 warm-up)")
    for name, default in DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--threads", type=int, default=None, help="torch (and accel) CPU threads")
    return p


def main(argv=None) -> int:
    """Run the demo with command line ``argv``; return 0 (PASS), 1 (mismatch) or 2."""
    args = _parser().parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("accel demo needs transformers: pip install 'accel[demo]'")
        return 2
    level = getattr(logging, os.environ.get("ACCEL_LOG", "warning").upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = max(1, args.steps)
    base = build_model(args.layers, args.embd, args.heads, args.seq)
    eager_model, accel_model = copy.deepcopy(base), copy.deepcopy(base)
    ids, labels = make_batch(args.batch, args.seq)
    n_par, n_grads = sum(p.numel() for p in base.parameters()), len(list(base.parameters()))
    print(f"accel demo: GPT-2 ({args.layers} layers, n_embd {args.embd}, {args.heads} heads, "
          f"{n_par / 1e6:.2f}M params), batch {args.batch} x seq {args.seq}, forward + backward, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")

    accel.reset_stats()
    t0 = time.perf_counter()
    loss_a = _accel_step(accel_model, ids, labels)  # first accel call: compiles or loads
    first_s = time.perf_counter() - t0
    # the dispatch filter is built in the background at a first run (accel.dispatch): the
    # timed steps below are the steady state, which has it
    filtered = accel.dispatch.wait()
    loss_e = train_step(eager_model, ids, labels)
    bad = _compare(eager_model, accel_model, loss_e, loss_a)
    log.info("first accel iteration (compiles or loads): %.2f s, %s; dispatch filter: %s",
             first_s, accel.stats(), filtered)
    if bad:
        print(f"FAIL: accel differs from eager in {len(bad)} of loss + {n_grads} gradients")
        for msg in bad[:10]:
            print("  " + msg.replace("\n", "\n    "))
        return 1
    print(f"PASS: loss ({loss_e.item():.6f}) and all {n_grads} parameter gradients"
          " match eager (torch.testing.assert_close defaults)")

    log.info("timing %d alternating steps of eager and accel", steps)
    t_e, t_a = time_steps([lambda: train_step(eager_model, ids, labels),
                           lambda: _accel_step(accel_model, ids, labels)], steps)
    me, ma = statistics.median(t_e) * 1e3, statistics.median(t_a) * 1e3
    print(f"\ntime per iteration (median of {steps} after 1 warm-up, eager and accel alternating):")
    print(f"  eager   {me:9.2f} ms")
    print(f"  accel   {ma:9.2f} ms   speedup {me / ma:.2f}x")
    print(f"  (first accel iteration, incl. compile/load: {first_s * 1e3:.0f} ms)")
    s = accel.stats()
    print("\naccel stats (this process):")
    for label, v in [("regions (flushes)", s["flushes"]), ("kernels run", s["kernel_runs"]),
                     ("eager replays", s["eager_replays"]), ("memory hits", s["memory_hits"]),
                     ("store hits", s["store_hits"]),
                     ("misses / compiles", f"{s['compiles']} (failures {s['compile_failures']})"),
                     ("compile time", f"{s['compile_time_s']:.2f} s"),
                     ("load time", f"{s['load_time_s'] * 1e3:.1f} ms")]:
        print(f"  {label:<20}{v}")
    if s["compiles"]:
        print(f"\n{s['compiles']} regions were compiled in this run and saved to the store."
              "\nRun the demo again in a new process: it should show 0 compiles (all store hits).")
    else:
        print("\n0 compiles: every kernel came from the on-disk store (a warm run).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
