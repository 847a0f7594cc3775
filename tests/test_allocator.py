"""The CPU output pool (accel/allocator.py): large region outputs reuse freed blocks, never
one that anything still holds."""
import os
import subprocess
import sys

import pytest
import torch

import accel
from accel import allocator
from plugin_runs import run_under  # tests/plugin_runs.py

close = torch.testing.assert_close

ROWS = 512  # x: [512, 1024] float32, 2 MiB: above allocator.MIN_BLOCK


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    monkeypatch.delenv("ACCEL_CPU_POOL_MB", raising=False)
    monkeypatch.setenv("ACCEL_CPU_POOL", "on")  # auto: off here, where accel tunes malloc
    allocator.configure(allocator._capacity() >> 20, "on")  # (a test may have turned it off)
    allocator.empty_cache()
    yield
    allocator.empty_cache()


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(ROWS, 1024)


def step(x):
    with accel.eager():
        return torch.sin(x) * 2 + 1


def ref(x):
    return torch.sin(x) * 2 + 1


def test_block_reused_once_free(x):
    assert ROWS * 1024 * 4 >= allocator.MIN_BLOCK
    y = step(x)
    p = y.data_ptr()
    z = step(x + 1)  # y is alive: another block
    assert z.data_ptr() != p
    close(y, ref(x))
    del y
    w = step(x - 1)  # y's block again (or z's dead intermediates'), already mapped
    assert w.data_ptr() in {p} | {b.ptr for b in allocator._blocks.values()}
    close(w, ref(x - 1))
    close(z, ref(x + 1))
    assert allocator.pool_stats()["blocks"] >= 2


def test_reused_block_is_a_fresh_tensor(x):
    y = step(x)
    y.add_(1)
    p = y.data_ptr()
    del y
    for _ in range(3):
        z = step(x)
        if z.data_ptr() == p:
            break
    assert z.data_ptr() == p
    assert z._base is None and z._version == 0 and not z.requires_grad
    close(z, ref(x))


@pytest.mark.parametrize("holder", ["view", "storage", "numpy", "dlpack", "autograd", "tensor"])
def test_block_held_elsewhere_is_not_reused(x, holder):
    y = step(x)
    a = torch.ones((), requires_grad=True)
    keep = {"view": lambda: y[1:],
            "storage": lambda: y.untyped_storage(),
            "numpy": lambda: y.numpy(),
            "dlpack": lambda: torch.utils.dlpack.to_dlpack(y),
            "autograd": lambda: (a * y).sum(),
            "tensor": lambda: y}[holder]()
    want = ref(x)
    p = y.data_ptr()
    del y
    outs = [step(x + i) for i in range(6)]  # every free block gets taken
    assert all(o.data_ptr() != p for o in outs)
    if holder == "view":
        close(keep, want[1:])
    elif holder == "numpy":
        close(torch.from_numpy(keep), want)
    elif holder == "autograd":
        keep.backward()
        close(a.grad, want.sum())
    elif holder == "tensor":
        close(keep, want)


def test_resized_block_leaves_the_pool(x):
    """A storage grown in place by its user is no longer a block of the pool's size: it
    leaves the pool instead of being handed out (and counted) as one."""
    y = step(x)
    y.resize_(ROWS * 4, 1024)
    del y
    z = step(x)
    close(z, ref(x))
    assert all(b.storage.nbytes() == b.nbytes for b in allocator._blocks.values())


def test_shared_memory_block_is_not_reused(x):
    """A storage moved to shared memory (say, sent to another process) may still be read
    there after this process drops it: the pool must not hand it out again."""
    y = step(x)
    y.share_memory_()
    assert y.is_shared()
    del y
    outs = [step(x + i) for i in range(6)]
    assert not any(o.is_shared() for o in outs)
    for i, o in enumerate(outs):
        close(o, ref(x + i))


def test_capacity_and_eviction(x, monkeypatch):
    block = ROWS * 1024 * 4
    base = allocator.pool_stats()["held_bytes"]  # blocks other tests' tensors still hold
    cap = (base >> 20) + (3 * block >> 20)  # those and three blocks, in MiB
    monkeypatch.setenv("ACCEL_CPU_POOL_MB", str(cap))
    ys = [step(x + i) for i in range(5)]  # each step: sin, mul, add outputs of one block each
    st = allocator.pool_stats()
    assert st["held_bytes"] <= cap << 20 and st["capacity_bytes"] == cap << 20
    assert st["held_bytes"] >= base + block  # it pooled some
    for i, y in enumerate(ys):
        close(y, ref(x + i))
    del ys
    assert allocator.empty_cache() > 0
    assert allocator.pool_stats()["held_bytes"] <= base


def test_empty_cache_keeps_blocks_in_use(x):
    y = step(x)
    allocator.empty_cache()
    st = allocator.pool_stats()
    assert st["held_bytes"] >= y.untyped_storage().nbytes() and st["free_bytes"] == 0
    close(y, ref(x))
    assert accel.empty_cache is allocator.empty_cache


def test_pool_off(x, monkeypatch):
    n = allocator.pool_stats()["blocks"]
    monkeypatch.setenv("ACCEL_CPU_POOL_MB", "0")
    ys = [step(x) for _ in range(3)]
    assert allocator.pool_stats()["blocks"] == n
    for y in ys:
        close(y, ref(x))


def test_small_outputs_not_pooled():
    a = torch.randn(16, 16)
    n = allocator.pool_stats()["blocks"]
    y = step(a)
    assert allocator.pool_stats()["blocks"] == n
    close(y, ref(a))


def test_dead_pooled_intermediates_are_not_written(x):
    """A pooled output is live only while held outside the pool: the region's dead
    intermediates stay unwritten (one live output), as without the pool."""
    from accel.interceptor import _state

    with accel.eager():
        y = torch.sin(x) * 2
        t = y + 1
        del y
        assert _state.region.liveness() == (False, False, True)
    close(t, ref(x))


def _child(inbox, outbox):
    t = inbox.get()
    outbox.put("got")
    assert inbox.get() == "go"  # the sender has dropped its tensor and run more steps
    outbox.put(float(t.sum()))


def test_tensor_sent_to_another_process_stays_intact(x):
    """torch.multiprocessing moves a sent CPU tensor into shared memory; after the sender
    drops it, the pool must not overwrite what the receiver still reads."""
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child, args=(inbox, outbox))
    p.start()
    try:
        y = step(x)
        want = float(ref(x).sum())
        inbox.put(y)
        assert outbox.get(timeout=120) == "got"
        del y
        outs = [step(x + 5) for _ in range(6)]  # would take a reused block
        inbox.put("go")
        got = outbox.get(timeout=120)
    finally:
        p.join(timeout=120)
    assert got == pytest.approx(want, rel=1e-5)
    assert not any(o.is_shared() for o in outs)


@pytest.mark.suite
def test_suites_with_every_output_pooled():
    """The interceptor suite and the random chains on the region core's pure-Python twin
    (accel/_core_py.py: the twin's one run of the interceptor suite), with every region
    output taken from the pool (tests/pool_everything.py): views, in-place writes, autograd
    and reads of pending outputs over reused blocks. Not the tests of codegen alone
    (``codegen``-marked: the same kernels, whatever core or allocator runs them)."""
    run_under("pool_everything", ["test_interceptor.py", "test_chains.py"], "-m", "not codegen",
              ACCEL_PURE_PYTHON="1")


def test_fork_while_another_thread_holds_the_pool():
    """A process forked while another thread is inside the pool (its lock held) can still
    allocate pooled outputs in the child."""
    import os
    import threading

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    held, release = threading.Event(), threading.Event()

    def hold():
        with allocator._lock:
            held.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(60)
    try:
        pid = os.fork()
        if pid == 0:  # child: the holder thread does not exist here
            code = 1
            try:
                import signal

                signal.alarm(30)  # a child stuck on the lock dies of SIGALRM
                # allocation only: OpenMP work in a forked child may hang for reasons of its own
                y = allocator.empty_strided((ROWS, 1024), (1024, 1), torch.float32, ROWS * 4096)
                code = 0 if y.shape == (ROWS, 1024) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        t.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


# -- a program's record and the next process's prefill -----------------------------------

_PROGRAM = """
import sys, threading, torch, accel
from accel import allocator
for t in threading.enumerate():
    if t.name == "accel-prefetch":
        t.join()
print("prefilled", sorted(b.nbytes for b in allocator._blocks.values()), flush=True)
x = torch.randn(512, 1024)
with accel.eager():
    y = torch.sin(x) * 2 + 1
    z = (torch.cos(x) + 3)[:256]
torch.testing.assert_close(y, torch.sin(x) * 2 + 1)
torch.testing.assert_close(z, (torch.cos(x) + 3)[:256])
print("after", sorted((b.nbytes, b.used) for b in allocator._blocks.values()))
"""


def _run_program(path, env, *args, ok=True, how="script"):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    e.update({"ACCEL_DISPATCH_FILTER": "0", "ACCEL_CPU_POOL": "on", **env})
    cmd = {"script": [sys.executable], "accel run": [sys.executable, "-m", "accel", "run"],
           "ACCEL_EAGER=1": [sys.executable]}[how]
    if how == "ACCEL_EAGER=1":
        e["ACCEL_EAGER"] = "1"
    p = subprocess.run([*cmd, str(path), *args], env=e, capture_output=True,
                       text=True, timeout=300)
    assert (p.returncode == 0) == ok, p.stderr[-3000:]
    return p.stdout if ok else p.stdout + p.stderr


@pytest.mark.parametrize("how", ["script", "accel run", "ACCEL_EAGER=1"])
def test_a_programs_next_process_finds_its_blocks_mapped(tmp_path, how):
    """A program's first process records its pool's block sizes in the store at exit; its
    next process pools and faults in blocks of those sizes at ``import accel`` (``accel
    run``, ``ACCEL_EAGER=1``: as accel starts), in the background, and its regions' outputs
    take them instead of fresh ones."""
    prog = tmp_path / "prog.py"
    prog.write_text(_PROGRAM)
    env = {"ACCEL_CACHE_DIR": str(tmp_path / "store")}
    first = _run_program(prog, env, how=how).splitlines()
    assert first[0] == "prefilled []", first  # no store yet: nothing to go by
    used = eval(first[1].removeprefix("after "))  # [(bytes, used), ...]: the region's outputs
    assert used and all(u for _, u in used), first
    second = _run_program(prog, env, how=how).splitlines()
    assert second[0] == f"prefilled {[n for n, _ in used]}", second
    assert second[1] == first[1], second  # every output took a prefilled block
    other = _run_program(prog, env, "--other", how=how)  # another command: no record yet
    assert "prefilled []" in other, other


@pytest.mark.parametrize("env", [{"ACCEL_CPU_POOL": "off"}, {"ACCEL_CPU_POOL_MB": "0"},
                                 {"ACCEL_DISABLE": "1"}, {"ACCEL_CPU_POOL": "often"}])
def test_no_prefill_where_the_pool_is_off(tmp_path, env):
    """Nothing is pooled ahead where regions' outputs will not come from the pool, accel is
    off, or a setting is invalid (the first enable reports it, naming the variable)."""
    prog = tmp_path / "prog.py"
    prog.write_text(_PROGRAM.replace('print("after"', 'print("after", allocator.pool_stats())\n#'))
    env0 = {"ACCEL_CACHE_DIR": str(tmp_path / "store")}
    assert "prefilled []" in _run_program(prog, env0)
    if env.get("ACCEL_CPU_POOL") == "often":
        err = _run_program(prog, env0 | env, ok=False)
        assert "prefilled []" in err and "ACCEL_CPU_POOL='often' is not valid" in err, err
        return
    out = _run_program(prog, env0 | env)
    assert "prefilled []" in out, out


def test_the_record_is_per_program(tmp_path):
    """Two commands (the same script with other arguments) keep records of their own; a
    ``python -c`` program has none."""
    from accel.store import Store

    store = Store(str(tmp_path / "s"))
    saved = sys.argv
    try:
        sys.argv = [str(tmp_path / "prog.py"), "--batch", "8"]
        a = allocator.program_key()
        sys.argv = [str(tmp_path / "prog.py"), "--batch", "16"]
        b = allocator.program_key()
        sys.argv = ["-c"]
        assert allocator.program_key() is None
    finally:
        sys.argv = saved
    assert a and b and a != b
    store.put_pool_record(a, [3 << 20, 1 << 20])
    assert store.pool_record(a) == [1 << 20, 3 << 20] and store.pool_record(b) is None
    assert store.stats() == dict.fromkeys(("hits", "misses", "compiles", "compile_failures"), 0)
    store.clear()
    assert store.pool_record(a) is None


@pytest.mark.parametrize("value", ["garbage", (1 << 20, -5), (1.5,), [1 << 20], None])
def test_a_damaged_record_is_none(tmp_path, value):
    from accel.store import _POOL, Store

    store = Store(str(tmp_path / "s"))
    store._side.set(_POOL + "p", value)
    assert store.pool_record("p") is None
    assert allocator.prefill(store, "p", 1 << 30) == 0


def test_prefill_stays_within_the_capacity_and_configure_off_releases_it():
    from accel.store import MemoryStore

    store = MemoryStore()
    store.put_pool_record("p", [1 << 20, 2 << 20, 4 << 20, 8 << 20])
    base = allocator.pool_stats()
    done = allocator.prefill(store, "p", base["held_bytes"] + (7 << 20))
    assert done == 7 << 20  # 1 + 2 + 4 MiB; 8 more would pass the capacity
    st = allocator.pool_stats()
    assert st["blocks"] == base["blocks"] + 3 and st["free_bytes"] == base["free_bytes"] + done
    assert not any(b.used for b in list(allocator._blocks.values())[-3:])
    allocator.configure(1024, "off")  # the first enable turns the pool off: blocks released
    st = allocator.pool_stats()
    assert st["free_bytes"] == 0 and st["held_bytes"] == base["held_bytes"] - base["free_bytes"]


def test_the_exit_records_only_blocks_outputs_used(tmp_path, x, monkeypatch):
    """What a process records at exit: the blocks its outputs used, not prefilled ones
    nothing took; nothing in a forked child (another pid), nor where it matches the record
    the pool was prefilled from."""
    from accel import runtime
    from accel.store import Store

    store = Store(str(tmp_path / "s"))
    monkeypatch.setattr(runtime, "_store", store)
    store.put_pool_record("prev", [5 << 20])
    assert allocator.prefill(store, "prev", 1 << 30) == 5 << 20  # never used below
    y = step(x)
    close(y, ref(x))
    monkeypatch.setattr(allocator, "_record", ("p", os.getpid() + 1))
    allocator._save_record()
    assert store.pool_record("p") is None  # a forked child
    monkeypatch.setattr(allocator, "_record", ("p", os.getpid()))
    allocator._save_record()
    rec = store.pool_record("p")
    assert rec and ROWS * 4096 in rec and (5 << 20) not in rec
    monkeypatch.setattr(allocator, "_prefilled", rec)
    store.put_pool_record("p", [1 << 20])
    allocator._save_record()  # unchanged since the prefill: not written again
    assert store.pool_record("p") == [1 << 20]


def test_blocks_reused_under_accel_enabled_twice(x):
    """accel enabled around a block that enables it again (``accel run`` or
    ``ACCEL_EAGER=1`` and a script's ``accel.eager()``): handing out a reused block is the
    pool's own ``set_`` call, which the outer mode once took for the program's and flushed
    the region in the middle of recording the call the block was for (IndexError, the
    program stopped)."""
    accel.enable()
    try:
        for _ in range(3):
            with accel.eager():
                y = torch.sin(x) * 2 + 1
                z = (torch.cos(x) + 3)[:256]
            close(y, ref(x))
            close(z, (torch.cos(x) + 3)[:256])
            del y, z
    finally:
        accel.disable()
