"""The kernel store: compiled artifacts behind a small get/put interface.

:class:`Store` keeps them on disk, per user, in a directory of mode 0700::

    index/    diskcache.Cache  "v<STORE_VERSION>:<key>" -> {"sha256", "artifact", "meta"} (LRU, size-limited)
    stats/    diskcache.Cache  counters, and "use:<key>" -> (last use, sha256); never evicted;
                               a found entry's last use and the counts are written at exit (touch);
                               "pool:<program>" -> the CPU output pool's block sizes at a
                               program's exit (accel.allocator.prefill); "ws:<program>" -> the
                               trie nodes and kernels it used (accel.runtime.prefetch_working_set)
    nodes/    diskcache.Cache  trie node digest -> output metadata of a call (so a new process
                               skips meta evaluation: accel.region.TrieNode)
    objects/  <sha256>.so      artifacts materialized for dlopen (or reading: CUDA cubins), written atomically
    locks/    <sha256(key)>.lock  per-key compile locks (flock: the OS drops them when a holder dies)

Index values are pickles, which is why the directory must be writable by its owner only.
:class:`MemoryStore` is the same interface in memory, for tests and for when the disk store cannot
be used; :func:`open_store` picks one.

Example::

    >>> import tempfile
    >>> s = Store(tempfile.mkdtemp())
    >>> s.put("k", b"\\x7fELF...", {"readable": "add(f32[4])"}).meta["size"]
    7
    >>> s.get("k").path.endswith(".so"), s.get("missing")
    (True, None)
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import hashlib
import logging
import os
import shutil
import sqlite3
import stat
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

import diskcache
import filelock

from . import config

__all__ = ["STORE_VERSION", "StoreError", "Entry", "Store", "MemoryStore", "open_store"]

STORE_VERSION = 1
COUNTERS = ("hits", "misses", "compiles", "compile_failures")
_PREFIX = f"v{STORE_VERSION}:"  # index keys; another format version never sees these entries
_USE = "use:"  # side-table keys of last-use records
_POOL = "pool:"  # side-table keys of programs' pool records
_WS = "ws:"  # side-table keys of programs' working sets; everything else there is a counter
_COUNT_LOCK = threading.Lock()  # the stores' unwritten counts


def _after_fork_in_child() -> None:
    global _COUNT_LOCK
    _COUNT_LOCK = threading.Lock()  # a build thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
log = logging.getLogger("accel.store")


class StoreError(Exception):
    """The store directory cannot be used: not creatable, not a directory, not writable, owned by
    another user, or writable by other users. The message names the path and the reason."""


@dataclass
class Entry:
    """One store entry. ``path``: a verified shared library ready for dlopen (None if negative).
    A negative entry records a compile failure (``reason``) so that compile is not retried."""

    key: str
    path: str | None
    meta: dict = field(default_factory=dict)
    negative: bool = False
    reason: str = ""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path``, fsync it, and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _empty_folder(folder: str) -> None:
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))


class _BaseStore:
    """The store logic, over ``_index`` (LRU key -> value), ``_reader`` (the same, read without
    refreshing LRU order), ``_side`` (counters and last-use records), ``_nodes`` (trie node
    metadata), the ``_objects`` folder, and ``_folders`` (emptied by ``clear()``)."""

    persistent = False
    _gc_age = 0.0  # object files younger than this (s) are never collected
    _exit_hook = False  # touch() registered to run at exit

    def __init__(self):
        self._touched: dict = {}  # key -> (last use, sha256), written by touch()
        self._counts = collections.Counter()  # record()'s counts, written by touch()

    def after_fork(self) -> None:
        """In a forked child: make afresh the locks a thread of the parent (a builder) may
        have held at the fork (called by ``accel.runtime``'s fork handler)."""

    def put(self, key: str, artifact: bytes, meta: dict) -> Entry:
        """Store ``artifact`` (shared library bytes) and ``meta`` (JSON-able) under ``key``: one
        atomic index write, then the object file. Adds ``created`` (epoch s), ``size`` (bytes) and
        ``store_version`` to the metadata. Returns the entry, with its object path."""
        sha, now = _sha(artifact), time.time()
        meta = {**meta, "created": now, "size": len(artifact), "store_version": STORE_VERSION}
        self._index.set(_PREFIX + key, {"sha256": sha, "artifact": bytes(artifact), "meta": meta})
        self._side.set(_USE + key, (now, sha))
        path = self._materialize(sha, artifact)
        if len(os.listdir(self._objects)) > len(self._index):  # entries were evicted
            self._collect()
        return Entry(key, path, meta)

    def put_negative(self, key: str, reason: str, meta: dict | None = None) -> None:
        """Record that building ``key`` failed (``reason``); :meth:`get` then returns a negative entry."""
        now = time.time()
        meta = {**(meta or {}), "created": now, "size": 0, "store_version": STORE_VERSION}
        self._index.set(_PREFIX + key, {"negative": True, "reason": reason, "meta": meta})
        self._side.set(_USE + key, (now, None))

    def get(self, key: str) -> Entry | None:
        """The entry for ``key``, or None on a miss. The artifact's sha256 is verified first: a
        corrupted entry is logged, deleted and reported as a miss, so the caller rebuilds it.
        Hits and misses are not counted here: callers :meth:`record` them."""
        try:
            v = self._reader.get(_PREFIX + key)  # LRU order and last use: touch() later
        except (diskcache.Timeout, sqlite3.Error):
            raise
        except Exception as e:  # a damaged value fails to unpickle
            return self._discard(key, None, f"unreadable: {type(e).__name__}: {e}")
        if v is None:
            return None
        if not isinstance(v, dict) or not isinstance(v.get("meta"), dict):
            return self._discard(key, None, "not an entry")
        if v.get("negative"):
            return Entry(key, None, v["meta"], True, v.get("reason", ""))
        sha, art = v.get("sha256"), v.get("artifact")
        if not isinstance(art, bytes) or _sha(art) != sha:
            return self._discard(key, sha, "checksum mismatch")
        path = self._materialize(sha, art)
        self._at_exit()
        self._touched[key] = (time.time(), sha)
        return Entry(key, path, v["meta"])

    def _at_exit(self) -> None:
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(self.touch)

    def touch(self) -> None:
        """Write what the hot path only noted: the last use of the entries :meth:`get`
        returned since the last call (LRU order and ``last_use``) and the counts of
        :meth:`record`, in one transaction, so that a hit costs no write. Runs at exit;
        :meth:`entries`, :meth:`info` and eviction see the last uses after that."""
        touched, self._touched = self._touched, {}
        with _COUNT_LOCK:
            counts, self._counts = self._counts, collections.Counter()
        if not touched and not counts:
            return
        try:
            with self._transact(self._index), self._transact(self._side):
                for key, rec in touched.items():
                    if self._index.get(_PREFIX + key) is not None:  # refreshes LRU order
                        self._side.set(_USE + key, rec)
                for name, n in counts.items():
                    self._side.incr(name, n, default=0)
        except Exception as e:  # noqa: BLE001 - only the LRU order and counts are lost
            log.debug("kernel store %s: last-use records and counters not written (%s)",
                      self.location, e)

    def get_node(self, digest: bytes):
        """The stored metadata of trie node ``digest`` (see :class:`accel.region.TrieNode`),
        or None. An unreadable value counts as missing."""
        try:
            return self._nodes.get(digest)
        except (diskcache.Timeout, sqlite3.Error):
            raise
        except Exception:  # noqa: BLE001 - a damaged value: recomputed by the caller
            return None

    def put_nodes(self, items: dict) -> None:
        """Store trie node metadata, ``{digest: metadata}``, in one transaction."""
        with self._transact(self._nodes):
            for k, v in items.items():
                self._nodes.set(k, v)

    def record(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a persistent counter: ``hits``, ``misses``, ``compiles``,
        ``compile_failures`` (noted in memory; :meth:`touch` adds it to the store at exit)."""
        self._at_exit()
        with _COUNT_LOCK:  # background builders record too
            self._counts[counter] += n

    def pool_record(self, program: str) -> list[int] | None:
        """The block sizes (bytes, ascending) of ``program``'s CPU output pool at its last
        exit (:meth:`put_pool_record`), or None: none recorded, or a value that is not a
        list of positive ints (a damaged or foreign record counts as none)."""
        try:
            v = self._side.get(_POOL + program)
        except Exception:  # noqa: BLE001 - unreadable: none
            return None
        if not isinstance(v, tuple) or not all(type(n) is int and n > 0 for n in v):
            return None
        return sorted(v)

    def put_pool_record(self, program: str, sizes) -> None:
        """Record ``program``'s pool block sizes (bytes) for its next process
        (:func:`accel.allocator.prefill`); kept until ``clear()``."""
        self._side.set(_POOL + program, tuple(sorted(int(n) for n in sizes)))

    def working_set(self, program: str) -> tuple[list[bytes], list[str]] | None:
        """The trie nodes (digests) and kernels (store keys) ``program``'s last process
        used, as it recorded them at exit (:meth:`put_working_set`), or None: none
        recorded, or a value of another form (a damaged or foreign record counts as none)."""
        try:
            v = self._side.get(_WS + program)
        except Exception:  # noqa: BLE001 - unreadable: none
            return None
        if (not isinstance(v, tuple) or len(v) != 2 or not all(isinstance(p, tuple) for p in v)
                or not all(type(d) is bytes for d in v[0]) or not all(type(k) is str for k in v[1])):
            return None
        return list(v[0]), list(v[1])

    def put_working_set(self, program: str, nodes, kernels) -> None:
        """Record the trie nodes (digests) and kernels (store keys) ``program`` used, for
        its next process (:func:`accel.runtime.prefetch_working_set`); kept until ``clear()``."""
        self._side.set(_WS + program, (tuple(nodes), tuple(kernels)))

    def stats(self) -> dict:
        """The counters as ``{name: int}`` (this process's unwritten counts included); the
        four standard ones are always present."""
        out = dict.fromkeys(COUNTERS, 0)
        out.update({k: int(self._side.get(k, 0)) for k in list(self._side.iterkeys())
                    if isinstance(k, str) and not k.startswith((_USE, _POOL, _WS))})
        with _COUNT_LOCK:
            pending = list(self._counts.items())
        for k, n in pending:
            out[k] = out.get(k, 0) + n
        return out

    def entries(self) -> list[dict]:
        """One dict per entry: ``key``, ``readable``, ``size`` (bytes), ``compile_time`` (s or None),
        ``last_use`` (epoch s), ``negative``. Listing leaves the LRU order alone."""
        out = []
        for k in self._keys():
            v = self._peek(k)
            if v is not None:
                meta = v.get("meta", {})
                out.append({"key": k, "readable": meta.get("readable", ""), "size": meta.get("size", 0),
                            "compile_time": meta.get("compile_time_s"),
                            "last_use": self._last_use(k) or meta.get("created"),
                            "negative": bool(v.get("negative"))})
        return out

    def find(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted (a unique prefix names an entry, as with git hashes)."""
        return sorted(k for k in self._keys() if k.startswith(prefix))

    def inspect(self, key: str) -> dict:
        """All metadata of ``key`` (``source`` included when stored) plus ``key``, ``sha256``,
        ``checksum_ok``, ``negative``, ``reason``, ``last_use``. Raises KeyError if absent."""
        v = self._peek(key)
        if v is None:
            raise KeyError(key)
        art, sha = v.get("artifact"), v.get("sha256")
        ok = None if v.get("negative") else isinstance(art, bytes) and _sha(art) == sha
        return {**v.get("meta", {}), "key": key, "sha256": sha, "checksum_ok": ok,
                "negative": bool(v.get("negative")), "reason": v.get("reason", ""),
                "last_use": self._last_use(key)}

    def clear(self, keys: list[str] | None = None) -> int:
        """Delete ``keys`` (exact keys), or with None everything: entries, counters, object files.
        Returns how many entries were removed."""
        if keys is None:
            n = self._index.clear()
            self._side.clear()
            with _COUNT_LOCK:
                self._counts.clear()
            self._nodes.clear()
            for folder in self._folders:
                _empty_folder(folder)
            return n
        n = 0
        for k in keys:
            v = self._peek(k)
            if self._index.delete(_PREFIX + k):
                n += 1
                self._forget(k, v and v.get("sha256"))
        return n

    def info(self) -> dict:
        """``location``, ``size_bytes`` (all files), ``entries``, ``size_limit_bytes``, and the counters."""
        return {"location": self.location, "size_bytes": self._size(), "entries": len(self._keys()),
                "size_limit_bytes": self.size_limit_bytes, **self.stats()}

    # -- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _transact(cache):
        transact = getattr(cache, "transact", None)
        return transact() if transact is not None else contextlib.nullcontext()

    def _keys(self) -> list[str]:
        return [k[len(_PREFIX):] for k in self._index.iterkeys() if isinstance(k, str) and k.startswith(_PREFIX)]

    def _peek(self, key: str):
        try:
            v = self._reader.get(_PREFIX + key)
        except Exception:  # unreadable: get() reports and drops it
            return None
        return v if isinstance(v, dict) else None

    def _last_use(self, key: str) -> float | None:
        rec = self._side.get(_USE + key)
        return rec[0] if rec else None

    def _materialize(self, sha: str, artifact: bytes) -> str:
        """Make sure ``objects/<sha>.so`` holds exactly ``artifact`` (compared byte for byte:
        cheaper than hashing it again, ``artifact``'s hash already checked); return its path."""
        path = os.path.join(self._objects, f"{sha}.so")
        try:
            with open(path, "rb") as f:
                ok = f.read() == artifact
        except OSError:
            ok = False
        if not ok:
            _write_atomic(path, artifact)
        return path

    def _forget(self, key: str, sha: str | None) -> None:
        self._side.delete(_USE + key)
        if sha:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._objects, f"{sha}.so"))

    def _discard(self, key: str, sha: str | None, why: str) -> None:
        log.warning("kernel store %s: entry %s is corrupted (%s); deleted, it will be rebuilt",
                    self.location, key, why)
        self._index.delete(_PREFIX + key)
        self._forget(key, sha)

    def _collect(self) -> None:
        """Remove the last-use records and object files of entries that were evicted."""
        names, live, keep = os.listdir(self._objects), set(self._keys()), set()
        for sk in list(self._side.iterkeys()):
            if isinstance(sk, str) and sk.startswith(_USE):
                rec = self._side.get(sk)
                if rec and sk[len(_USE):] in live:
                    keep.add(rec[1])
                else:
                    self._side.delete(sk)
        young = time.time() - self._gc_age  # a younger file may be another process's put in progress
        for name in names:
            p = os.path.join(self._objects, name)
            with contextlib.suppress(OSError):
                if name.removesuffix(".so") not in keep and os.stat(p).st_mtime <= young:
                    os.unlink(p)

    def _size(self) -> int:
        with os.scandir(self._objects) as it:
            return sum(e.stat().st_size for e in it if e.is_file())


class Store(_BaseStore):
    """The persistent, diskcache-backed kernel store (layout in the module docstring).

    ``directory`` defaults to :func:`accel.config.cache_dir`, ``size_limit_mb`` (MiB) to
    ``ACCEL_CACHE_SIZE_MB``; least recently used entries are evicted beyond it. Each artifact is kept
    twice (index and objects/), so the index gets half of the limit.

    Raises:
        StoreError: the directory cannot be created or used safely (message: path and reason).
        accel.config.ConfigError: an ``ACCEL_*`` variable it reads is invalid.
    """

    persistent = True
    _gc_age = 60.0

    def __init__(self, directory: str | None = None, size_limit_mb: int | None = None):
        self.location, self.size_limit_bytes = self.settings(directory, size_limit_mb)
        d = self.location
        super().__init__()
        _secure_dir(d)
        self._folders = self._objects, self._locks = os.path.join(d, "objects"), os.path.join(d, "locks")
        try:
            for sub in self._folders:
                os.makedirs(sub, 0o700, exist_ok=True)
            self._reader = diskcache.Cache(os.path.join(d, "index"))
            self._reader.reset("eviction_policy", "none", update=False)  # this handle only
            self._nodes = diskcache.Cache(os.path.join(d, "nodes"))
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"kernel store {d}: cannot open it ({e})") from e
        self._open_lock, self._writers = threading.Lock(), {}

    @staticmethod
    def settings(directory: str | None = None, size_limit_mb: int | None = None) -> tuple:
        """(absolute directory, size limit in bytes) of a store opened with these arguments
        now: ``ACCEL_CACHE_DIR`` and ``ACCEL_CACHE_SIZE_MB`` where they are None.

        Raises:
            accel.config.ConfigError: an ``ACCEL_*`` variable it reads is invalid.
        """
        d = os.path.abspath(os.path.expanduser(directory or config.cache_dir()))
        mb = config.flag("ACCEL_CACHE_SIZE_MB") if size_limit_mb is None else size_limit_mb
        return d, int(mb * 2**20)

    # The handles that write (the LRU index, counters and last uses) open at their first
    # use: a process that only finds kernels writes at exit (touch), and its first call
    # does not pay for opening them (about 2.5 ms each).
    @property
    def _index(self):
        return self._open("index", size_limit=self.size_limit_bytes // 2,
                          eviction_policy="least-recently-used")

    @property
    def _side(self):
        return self._open("stats")

    def _open(self, sub: str, **settings):
        """The writing handle of ``sub``, opened at the first call. An unusable ``stats``
        database costs only the counters and last uses (one warning; kept in memory);
        an unusable index raises :class:`StoreError` (the caller runs eagerly)."""
        cache = self._writers.get(sub)
        if cache is None:
            with self._open_lock:
                cache = self._writers.get(sub)
                if cache is None:
                    try:
                        cache = diskcache.Cache(os.path.join(self.location, sub), **settings)
                    except (OSError, sqlite3.Error) as e:
                        if sub == "index":
                            raise StoreError(f"kernel store {self.location}: cannot write its index ({e})") from e
                        log.warning("kernel store %s: %s/ unusable (%s); counters and last uses are "
                                    "kept in this process only", self.location, sub, e)
                        cache = _DictCache()
                    self._writers[sub] = cache
        return cache

    def after_fork(self) -> None:
        self._open_lock = threading.Lock()

    @contextlib.contextmanager
    def compile_lock(self, key: str):
        """Exclusive inter-process lock for building ``key``::

            with store.compile_lock(k):
                e = store.get(k)
                if e is None:
                    ...build...; store.put(k, artifact, meta)

        Waits at most 2 * ``ACCEL_COMPILE_TIMEOUT`` seconds, then warns and goes on unlocked. The lock
        dies with its holder, so a killed compile never blocks the others."""
        timeout = config.flag("ACCEL_COMPILE_TIMEOUT") * 2
        lock = filelock.FileLock(os.path.join(self._locks, _sha(key.encode()) + ".lock"), timeout=timeout)
        try:
            lock.acquire()
            held = True
        except (filelock.Timeout, OSError) as e:
            held = False
            log.warning("kernel store %s: no compile lock for %s within %d s (%s); building without it",
                        self.location, key, timeout, type(e).__name__)
        try:
            yield
        finally:
            if held:
                lock.release()

    def _size(self) -> int:
        return self._index.volume() + self._side.volume() + self._nodes.volume() + super()._size()


def _secure_dir(d: str) -> None:
    """Create ``d`` (and missing parents) with mode 0700, or check an existing one is ours alone."""
    try:
        missing, p = [], d
        while not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for p in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(p, 0o700)
        if missing:
            os.chmod(d, 0o700)
        st = os.stat(d)
    except OSError as e:
        raise StoreError(f"kernel store {d}: cannot create or open it ({e.strerror or e})") from e
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"kernel store {d}: not a directory")
    if st.st_uid != os.geteuid():
        raise StoreError(f"kernel store {d}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise StoreError(f"kernel store {d}: other users can write it (mode {st.st_mode & 0o777:o}); "
                         f"`chmod 700 {d}` to use it")
    if not os.access(d, os.W_OK | os.X_OK):
        raise StoreError(f"kernel store {d}: not writable")


class _DictCache:
    """The part of ``diskcache.Cache``'s interface the stores use, in an ordered dict: LRU,
    evicting the oldest values beyond ``size_limit`` bytes of artifacts (never the newest)."""

    def __init__(self, size_limit: float = float("inf")):
        self._d, self._lock = collections.OrderedDict(), threading.RLock()
        self.size_limit, self.touch = size_limit, True

    def get(self, k, default=None):
        with self._lock:
            if self.touch and k in self._d:
                self._d.move_to_end(k)
            return self._d.get(k, default)

    def set(self, k, v) -> None:
        size = lambda v: len(v.get("artifact", b"")) if isinstance(v, dict) else 0  # noqa: E731
        with self._lock:
            self._d[k] = v
            self._d.move_to_end(k)
            total = sum(map(size, self._d.values()))
            while total > self.size_limit and len(self._d) > 1:
                total -= size(self._d.popitem(last=False)[1])

    def incr(self, k, n=1, default=0) -> int:
        with self._lock:
            self._d[k] = self._d.get(k, default) + n
            return self._d[k]

    def delete(self, k) -> bool:
        return self._d.pop(k, self) is not self

    def iterkeys(self):
        return iter(list(self._d))

    def clear(self) -> int:
        with self._lock:
            n = len(self._d)
            self._d.clear()
            return n

    def __len__(self) -> int:
        return len(self._d)


class MemoryStore(_BaseStore):
    """The store interface kept in this process's memory: LRU within ``size_limit_mb`` MiB
    (default ``ACCEL_CACHE_SIZE_MB``); ``compile_lock`` excludes this process's threads only.
    Artifacts go to a private temporary directory (removed with the store) so paths can be dlopened."""

    def __init__(self, size_limit_mb: int | None = None):
        mb = config.flag("ACCEL_CACHE_SIZE_MB") if size_limit_mb is None else size_limit_mb
        self.size_limit_bytes = int(mb * 2**20)
        super().__init__()
        self._objects = tempfile.mkdtemp(prefix="accel-store-")
        self._folders, self.location = (self._objects,), f"memory ({self._objects})"
        self._index, self._side = _DictCache(self.size_limit_bytes), _DictCache()
        self._nodes = _DictCache()
        self._reader = copy.copy(self._index)  # the same dict and lock, read without touching
        self._reader.touch = False
        self._locks = collections.defaultdict(threading.Lock)
        weakref.finalize(self, shutil.rmtree, self._objects, True)

    def compile_lock(self, key: str) -> contextlib.AbstractContextManager:
        """Exclusive lock on ``key`` among this process's threads."""
        return self._locks[key]

    def after_fork(self) -> None:
        for cache in (self._index, self._side, self._nodes):
            cache._lock = threading.RLock()
        self._reader._lock = self._index._lock
        self._locks = collections.defaultdict(threading.Lock)


def open_store() -> Store | MemoryStore:
    """The persistent :class:`Store` at :func:`accel.config.cache_dir`; if that cannot be used, one
    warning naming the path and reason, and a :class:`MemoryStore` (kernels will not persist).

    Raises:
        accel.config.ConfigError: an ``ACCEL_*`` variable it reads is invalid.
    """
    try:
        return Store()
    except (StoreError, OSError, sqlite3.Error) as e:
        why = e if isinstance(e, StoreError) else f"kernel store {config.cache_dir()}: {e}"
        log.warning("%s; compiled kernels will not persist beyond this process (using an in-memory store)", why)
        return MemoryStore()
