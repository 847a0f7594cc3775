"""Tests of accel.store: the disk Store, its in-memory twin, permissions, integrity, locking."""
import glob
import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from accel import store as st
from accel.store import Entry, MemoryStore, Store, StoreError, open_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = {"readable": "add(f32[4], f32[4])", "source": "int main(){}", "compile_time_s": 0.25}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(d))
    return d


@pytest.fixture(params=["disk", "memory"])
def store(request, cache_dir):
    return Store() if request.param == "disk" else MemoryStore()


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# -- both stores ------------------------------------------------------------------------------
def test_put_get_round_trip(store):
    art = b"\x7fELF" + os.urandom(1000)
    e = store.put("k1", art, META)
    assert isinstance(e, Entry) and not e.negative
    assert e.meta["size"] == len(art) and e.meta["store_version"] == st.STORE_VERSION
    got = store.get("k1")
    assert got.key == "k1" and got.meta["readable"] == META["readable"]
    assert _read(got.path) == art and os.path.basename(got.path) == hashlib.sha256(art).hexdigest() + ".so"
    assert store.get("missing") is None


def test_object_file_rewritten_if_missing_or_wrong(store):
    path = store.put("k", b"abc", {}).path
    os.unlink(path)
    assert _read(store.get("k").path) == b"abc"
    with open(path, "wb") as f:
        f.write(b"xyz")
    assert _read(store.get("k").path) == b"abc"


def test_negative_entry(store):
    store.put_negative("bad", "gcc: error: boom", {"readable": "weird_op"})
    e = store.get("bad")
    assert e.negative and e.path is None and e.reason == "gcc: error: boom"
    [row] = store.entries()
    assert row["negative"] and row["readable"] == "weird_op" and row["size"] == 0
    assert store.inspect("bad")["reason"] == "gcc: error: boom"


def test_entries_find_inspect_info(store):
    store.put("aaaa1", b"1" * 10, META)
    store.put("aaab2", b"2" * 20, {"readable": "mul"})
    store.record("hits", 3)
    store.record("misses")
    store.record("compiles", 2)
    rows = {r["key"]: r for r in store.entries()}
    assert set(rows) == {"aaaa1", "aaab2"}
    assert rows["aaaa1"]["size"] == 10 and rows["aaaa1"]["compile_time"] == 0.25
    assert rows["aaaa1"]["readable"] == META["readable"] and not rows["aaaa1"]["negative"]
    assert rows["aaab2"]["compile_time"] is None and abs(rows["aaab2"]["last_use"] - time.time()) < 60
    assert store.find("aaa") == ["aaaa1", "aaab2"] and store.find("aaaa") == ["aaaa1"] and store.find("z") == []
    m = store.inspect("aaaa1")
    assert m["source"] == "int main(){}" and m["checksum_ok"] and m["size"] == 10
    assert m["sha256"] == hashlib.sha256(b"1" * 10).hexdigest()
    with pytest.raises(KeyError):
        store.inspect("nope")
    i = store.info()
    assert i["entries"] == 2 and i["size_bytes"] >= 30 and i["size_limit_bytes"] == 1024 * 2**20
    assert (i["hits"], i["misses"], i["compiles"], i["compile_failures"]) == (3, 1, 2, 0)
    assert store.stats() == {"hits": 3, "misses": 1, "compiles": 2, "compile_failures": 0}


def test_last_use_updated_by_get(store):
    """A hit writes nothing on the hot path: its last use is recorded by touch() (at exit)."""
    store.put("k", b"x", {})
    before = store.entries()[0]["last_use"]
    time.sleep(0.02)
    store.get("k")
    assert store.entries()[0]["last_use"] == before
    store.touch()
    assert store.entries()[0]["last_use"] > before


def test_counts_written_at_touch(cache_dir):
    """record() writes nothing on the hot path either: the same store counts at once,
    another handle (another process) sees the counts once touch() (exit) wrote them."""
    a, b = Store(), Store()
    a.record("hits", 2)
    a.record("misses")
    assert a.stats()["hits"] == 2 and b.stats()["hits"] == 0
    a.touch()
    a.record("hits")
    assert b.stats() == {"hits": 2, "misses": 1, "compiles": 0, "compile_failures": 0}
    assert a.stats()["hits"] == 3


def test_damaged_stats_database_keeps_kernels(cache_dir, caplog):
    """A stats/ database that is not one (its handle opens lazily) costs the counters
    and last uses only: kernels are still stored and found, with one warning."""
    first = Store()
    first.record("hits")
    first.touch()  # stats/ exists now
    for name in os.listdir(cache_dir / "stats"):
        (cache_dir / "stats" / name).write_bytes(b"not a database" * 100)
    s = Store()
    e = s.put("k", b"artifact", {})
    s.record("hits")
    assert s.get("k").path == e.path and s.stats()["hits"] == 1
    s.touch()
    assert "counters and last uses are kept in this process only" in caplog.text
    again = Store()
    assert again.get("k") is not None
    again.touch()  # its last use: nothing left for the exit to write


def test_clear_keys_and_all(store):
    paths = [store.put(f"k{i}", bytes([i]) * 8, {}).path for i in range(3)]
    store.record("compiles", 3)
    assert store.clear(["k0", "nope"]) == 1
    assert store.get("k0") is None and not os.path.exists(paths[0]) and store.get("k1") is not None
    assert store.clear() == 2
    assert store.entries() == [] and store.info()["entries"] == 0 and store.stats()["compiles"] == 0
    assert not any(os.path.exists(p) for p in paths)


def test_lru_evicts_least_recently_used(tmp_path):
    # Index limit is half of 1 MiB; 40 KiB artifacts: about a dozen fit. k0 is read after every
    # put, so it stays while the others (least recently used) are evicted.
    for s in (Store(str(tmp_path / "s"), size_limit_mb=1), MemoryStore(size_limit_mb=0.5)):
        s._gc_age = 0  # collect object files of evicted entries at once (default: after 60 s)
        for i in range(30):
            s.put(f"k{i}", bytes([i]) * 40_000, {})
            assert s.get("k0") is not None
            s.touch()
        keys = set(s.find("k"))
        assert "k0" in keys and "k29" in keys and "k1" not in keys and len(keys) < 20
        assert len(os.listdir(s._objects)) == len(keys) and s.info()["size_bytes"] < 2**20


def test_memory_store_compile_lock_excludes_threads():
    s, inside, peak = MemoryStore(), [], []

    def work():
        with s.compile_lock("k"):
            inside.append(1)
            peak.append(len(inside))
            time.sleep(0.05)
            inside.pop()

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert max(peak) == 1


# -- disk store: directory --------------------------------------------------------------------
def test_directory_created_0700(tmp_path):
    d = tmp_path / "a" / "b" / "accel"
    s = Store(str(d))
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(d / "objects").st_mode & 0o777 == 0o700
    assert s.info()["location"] == str(d)


def test_default_directory_from_env(cache_dir):
    assert Store().location == str(cache_dir) and os.path.isdir(cache_dir)


def test_refuses_group_or_world_writable_dir(cache_dir, caplog):
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o777)
    with pytest.raises(StoreError, match="other users can write") as ei:
        Store()
    assert str(cache_dir) in str(ei.value)
    with caplog.at_level(logging.WARNING, logger="accel.store"):
        s = open_store()
    assert isinstance(s, MemoryStore) and not s.persistent
    [rec] = [r for r in caplog.records if r.name == "accel.store"]
    assert str(cache_dir) in rec.getMessage() and "not persist" in rec.getMessage()
    s.put("k", b"abc", {})  # the fallback works
    assert _read(s.get("k").path) == b"abc"


def test_refuses_a_file(cache_dir):
    cache_dir.write_text("not a directory")
    with pytest.raises(StoreError, match="not a directory"):
        Store()


def test_refuses_dir_of_another_user(cache_dir, monkeypatch):
    cache_dir.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(cache_dir).st_uid + 1)
    with pytest.raises(StoreError, match="owned by uid"):
        Store()


def test_open_store_returns_disk_store(cache_dir):
    s = open_store()
    assert isinstance(s, Store) and s.persistent


# -- disk store: integrity ----------------------------------------------------------------------
def test_tampered_artifact_is_dropped(cache_dir, caplog):
    s = Store()
    good = s.put("k", b"good artifact", META)
    # Same sha, different bytes: what a bit flip in the stored value looks like.
    s._index.set(st._PREFIX + "k", {"sha256": hashlib.sha256(b"good artifact").hexdigest(),
                                    "artifact": b"evil artifact", "meta": good.meta})
    with caplog.at_level(logging.WARNING, logger="accel.store"):
        assert s.get("k") is None
    assert "corrupted" in caplog.text and "checksum" in caplog.text
    assert s.find("k") == [] and not os.path.exists(good.path)
    assert Store().get("k") is None


def test_edited_value_file_is_dropped(cache_dir, caplog):
    s = Store()
    art = bytes(range(256)) * 400  # > 32 KiB: diskcache keeps the value in its own file
    s.put("k", art, META)
    [val] = glob.glob(str(cache_dir / "index" / "**" / "*.val"), recursive=True)
    data = bytearray(_read(val))
    data[len(data) // 2] ^= 0xFF
    with open(val, "wb") as f:
        f.write(data)
    with caplog.at_level(logging.WARNING, logger="accel.store"):
        assert Store().get("k") is None
    assert "corrupted" in caplog.text and s.find("k") == []


def test_garbled_value_file_is_dropped(cache_dir, caplog):
    s = Store()
    s.put("k", os.urandom(50_000), META)
    [val] = glob.glob(str(cache_dir / "index" / "**" / "*.val"), recursive=True)
    with open(val, "wb") as f:
        f.write(b"garbage, not a pickle")
    with caplog.at_level(logging.WARNING, logger="accel.store"):
        assert s.get("k") is None
    assert "unreadable" in caplog.text and s.find("k") == []


# -- disk store: concurrency ------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from accel.store import Store
    key, tag, mode = sys.argv[1:4]
    s = Store()
    open(tag + ".ready", "w").close()
    while mode == "race" and not os.path.exists(os.path.join(os.environ["ACCEL_CACHE_DIR"], "..", "go")):
        time.sleep(0.005)
    with s.compile_lock(key):
        if mode == "hang":
            open(tag + ".locked", "w").close()
            time.sleep(60)
        if s.get(key) is None:
            time.sleep(0.5)  # the "compile"
            s.put(key, b"artifact from " + tag.encode(), {{}})
            s.record("compiles")
""")


def _spawn(tmp_path, key, tag, mode):
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=ROOT))
    return subprocess.Popen([sys.executable, str(script), key, str(tmp_path / tag), mode])


def _wait_for(path, timeout=30):
    end = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < end, f"timed out waiting for {path}"
        time.sleep(0.01)


def test_two_processes_compile_once(tmp_path, cache_dir):
    Store()
    procs = [_spawn(tmp_path, "shared", f"p{i}", "race") for i in range(2)]
    for i in range(2):
        _wait_for(tmp_path / f"p{i}.ready")
    (tmp_path / "go").touch()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    s = Store()
    assert s.stats()["compiles"] == 1
    assert _read(s.get("shared").path).startswith(b"artifact from ")


def test_killed_compile_leaves_no_entry_and_no_lock(tmp_path, cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("ACCEL_COMPILE_TIMEOUT", "5")  # a stuck lock would cost 10 s and warn
    proc = _spawn(tmp_path, "victim", "p", "hang")
    _wait_for(tmp_path / "p.locked")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    s = Store()
    assert s.get("victim") is None and s.find("") == []
    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="accel.store"), s.compile_lock("victim"):
        assert time.time() - t0 < 1
        s.put("victim", b"rebuilt", {})
    assert "no compile lock" not in caplog.text
    assert _read(s.get("victim").path) == b"rebuilt"


def test_compile_lock_timeout_proceeds_with_warning(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("ACCEL_COMPILE_TIMEOUT", "1")
    s, done = Store(), []

    def second():
        with s.compile_lock("k"):
            done.append(time.time())

    with s.compile_lock("k"):
        t0 = time.time()
        with caplog.at_level(logging.WARNING, logger="accel.store"):
            t = threading.Thread(target=second)
            t.start()
            t.join(timeout=10)
    assert done and 1.5 < done[0] - t0 < 5
    assert "no compile lock" in caplog.text


# -- the precompiled header -----------------------------------------------------------------
_KERNEL = ('#include "accel/cpu_math.h"\n'
           'extern "C" void k(const float* x, float* y, int n) {\n'
           '  #pragma omp simd\n  for (int i = 0; i < n; ++i) y[i] = sinf(x[i]) * 2.0f + 1.0f;\n}\n')


@pytest.fixture
def pch(monkeypatch):
    """accel.build's precompiled-header state, fresh for the test (and restored after it)."""
    from accel import build

    monkeypatch.setattr(build, "_pch", {})
    monkeypatch.setattr(build, "_cpu_builds", 0)
    return build


def test_kernels_build_with_the_precompiled_header_in_the_store(cache_dir, pch):
    """A process's PCH_AFTER_BUILDS-th CPU kernel build starts building accel/cpu_math.h's
    precompiled header into the store; the builds after it include it (gcc finds the header
    through it alone) and give the library built without it, byte for byte; a new
    process's first build finds it in the store."""
    s = Store()
    plain = pch.build(_KERNEL, "k")  # no store: never the precompiled header
    for _ in range(pch.PCH_AFTER_BUILDS):  # the first looks it up; the last starts its build
        assert pch.build(_KERNEL, "k", store=s) == plain
    key = pch.pch_key()
    for t in threading.enumerate():
        if t.name == "accel-pch":
            t.join(120)
    d = pch._pch[key]
    assert d is not None and s.inspect(key)["readable"] == "precompiled header accel/cpu_math.h"
    assert pch.build(_KERNEL, "k", store=s) == plain
    # without accel's include directory, the header is found only through the .gch
    src = cache_dir.parent / "k.cpp"
    src.write_text(_KERNEL)
    r = subprocess.run([pch._cxx(), *pch.CXXFLAGS, "-I", d, str(src), "-o", str(cache_dir.parent / "k.so")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pch._pch.clear()
    pch._cpu_builds = 0
    assert pch.build(_KERNEL, "k", store=Store()) == plain and pch._pch[key] is not None
    assert s.stats()["compiles"] == 0  # not a kernel


def test_a_precompiled_header_that_breaks_a_build_is_dropped(cache_dir, pch, caplog):
    """A precompiled header in the store that gcc reads but that breaks a kernel (here one of
    a header that defines ``sinf`` away; gcc ignores one it cannot read) is retried without:
    the kernel builds as without it, and the process stops using it, with a warning. A
    failed build of the header is a negative entry: no build uses or retries it."""
    s = Store()
    key = pch.pch_key()
    bad = cache_dir.parent / "bad.h"
    bad.write_text("#define sinf(x) not_a_function(x)\n")
    subprocess.run([pch._cxx(), *pch.CXXFLAGS, "-x", "c++-header", str(bad), "-o", str(bad) + ".gch"],
                   check=True)
    s.put(key, (cache_dir.parent / "bad.h.gch").read_bytes(), {"readable": "precompiled header"})
    plain = pch.build(_KERNEL, "k")
    with caplog.at_level(logging.WARNING, logger="accel.build"):
        for _ in range(3):
            assert pch.build(_KERNEL, "k", store=s) == plain
    assert pch._pch[key] is None and "failed with it" in caplog.text
    s.put_negative(key, "g++ failed", {})
    pch._pch.clear()
    pch._cpu_builds = 0
    for _ in range(pch.PCH_AFTER_BUILDS + 1):
        assert pch.build(_KERNEL, "k", store=s) == plain
    for t in threading.enumerate():
        if t.name == "accel-pch":
            t.join(120)
    assert pch._pch[key] is None and s.get(key).negative


# -- a program's working set: its next process reads it ahead --------------------------------
@pytest.mark.parametrize("value", ["junk", (1, 2), ((b"a",), ("k", 3)), (("a",), ("k",)), ((b"a",),)])
def test_a_damaged_working_set_is_none(store, value):
    store._side.set(st._WS + "p", value)
    assert store.working_set("p") is None
    store.put_working_set("p", [b"d1", b"d2"], ["k1"])
    assert store.working_set("p") == ([b"d1", b"d2"], ["k1"])
    assert "ws:p" not in store.stats()  # not a counter


def test_a_working_set_of_missing_entries_reads_nothing_ahead(store, monkeypatch):
    """Entries evicted (or never stored) since the record: nothing is read ahead for them,
    and nothing raises."""
    from accel import region, runtime

    monkeypatch.setattr(runtime, "prefetched_from", None)
    monkeypatch.setattr(runtime, "_PREFETCHED_KERNELS", {})
    monkeypatch.setattr(runtime, "_ws_record", (None, 0, None))  # no exit record
    monkeypatch.setattr(region, "PREFETCHED_NODES", {})
    store.put_working_set("p", [b"\0" * 32], ["0" * 64])
    assert runtime.prefetch_working_set(store, "p") == 0
    assert runtime.prefetched_from is store and not runtime._PREFETCHED_KERNELS
    assert not region.PREFETCHED_NODES
    assert runtime.prefetch_working_set(store, "unknown") == 0


_WS_PROGRAM = """
import sys, torch, accel
from accel import dispatch, runtime
from accel.store import Store
if dispatch._prefetch is not None:
    dispatch._prefetch.join()
lookups = []
get, get_node = Store.get, Store.get_node
Store.get = lambda self, k, *a, **kw: lookups.append(k) or get(self, k, *a, **kw)
Store.get_node = lambda self, d: lookups.append(d) or get_node(self, d)
x = torch.randn(64, 256)
with accel.eager():
    y = (torch.sin(x) * 2 + 1).softmax(-1)
    z = torch.nn.functional.layer_norm(y + x, [256])
torch.testing.assert_close(z, torch.nn.functional.layer_norm((torch.sin(x) * 2 + 1).softmax(-1) + x, [256]))
print("lookups", len(lookups), "read ahead", runtime.prefetched_from is not None,
      "left", len(runtime._PREFETCHED_KERNELS), "stats", accel.stats()["store_hits"], accel.stats()["compiles"])
"""


def test_a_programs_next_process_reads_its_working_set_ahead(tmp_path):
    """A program's first process records the trie nodes and kernels it used at exit; its
    next process reads them from the store, and loads the kernels, at ``import accel`` in
    the background: its first call looks nothing up in the store (a store hit, no
    compile). Another command has no record yet."""
    prog = tmp_path / "prog.py"
    prog.write_text(_WS_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update({"ACCEL_DISPATCH_FILTER": "0", "ACCEL_CACHE_DIR": str(tmp_path / "store")})

    def run(*args):
        p = subprocess.run([sys.executable, str(prog), *args], env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout.split()

    first = run()
    assert first[1] != "0" and first[-1] == "1", first  # looked up, then compiled one kernel
    second = run()
    assert second[1] == "0" and second[4:] == ["True", "left", "0", "stats", "1", "0"], second
    other = run("--other")
    assert other[1] != "0" and other[4] == "False", other
