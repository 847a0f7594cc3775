"""Build: compile generated C++ into a shared library with the system compiler.

Compiler discovery (``$ACCEL_CXX``, default ``g++``), flags, a timeout that kills a hung
compile, and the compiler identity that goes into every store key.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import config

log = logging.getLogger("accel.build")

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "include")
if not os.path.isdir(os.path.join(INCLUDE_DIR, "accel")):  # installed (non-editable) layout
    INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")

#: No -ffast-math: results must match eager. -fno-math-errno lets gcc call libmvec;
#: -fno-trapping-math (no FP exceptions are ever read: results are unchanged) lets it
#: vectorize floor and selects; -fwrapv gives integer overflow eager's wrap-around; no FMA
#: contraction (eager has none). -mprefer-vector-width=512: gcc tunes Intel server CPUs to
#: 256-bit vectors, as eager's own AVX-512 kernels are not (on the 2-core Intel Xeon dev VM,
#: which gcc 12 takes for a Rocket Lake, bias + tanh-GELU on [2048, 4096] float32 ran 9.4-11.4
#: ms with 256-bit vectors, 3.4-3.5 with 512); a CPU without AVX-512 ignores it.
#: -fno-tree-pre -fno-tree-sink: two GIMPLE passes that run before the vectorizer and undo
#: the if-conversion it needs, in loops of selects accel renders everywhere. PRE moved a
#: compare of a select's result into the select (``isnan(c ? x : lo)`` became ``c ?
#: isnan(x) : isnan(lo)``: a select of bools, which gcc 12 does not vectorize): every
#: ``clamp`` and ``hardtanh`` ran scalar. Sinking moved a select's arm into a branch of its
#: own (a 16-bit rounding, a ``log``: a call only one arm needs), which the vectorizer's
#: if-conversion cannot take back: float16 ``where``, ``logit`` and ``smooth_l1_loss`` ran
#: scalar. accel's own passes CSE the graph first; no workload measured slower without the
#: two (eightieth round: ``bench_cpu.py``, ``bench/gcc_shapes.py``; ``bench/vector_audit.py``
#: over a test-suite store: 130 of 2172 kernels scalar before, 114 after).
CXXFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared",
            "-std=c++17", "-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-ffp-contract=off",
            "-fno-tree-pre", "-fno-tree-sink", "-w"]
LIBS = ["-lmvec", "-lm"]


class BuildError(RuntimeError):
    """The compiler is missing, failed, or timed out (message carries its output)."""


def summary(message: str, limit: int = 300) -> str:
    """A failure's message in one line, for a warning: its first line and, where a
    compiler's output follows, the first line of it that reports an error (``x.cpp:71:19:
    error: 't21' was not declared``), at most ``limit`` characters."""
    lines = message.splitlines() or [""]
    error = next((ln.strip() for ln in lines[1:] if "error" in ln), "")
    return f"{lines[0]} {error}".strip()[:limit]


class BuildTimeout(BuildError):
    """The compiler ran past ``ACCEL_COMPILE_TIMEOUT`` seconds and was killed."""


@functools.lru_cache(maxsize=None)
def _identity(cxx: str) -> str:
    """The compiler's identity for store keys: its resolved path, size and modification
    time (ccache's default ``compiler_check``), so that no process has to run it first."""
    path = shutil.which(cxx)
    if path is None:
        raise BuildError(f"C++ compiler {cxx!r} not found (set ACCEL_CXX)")
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise BuildError(f"cannot stat {real}: {e}") from e
    return f"{real}|{st.st_size}|{st.st_mtime_ns}"


@functools.lru_cache(maxsize=1)
def cpu_isa() -> str:
    """A short, stable description of the CPU's instruction set, core count and last-level
    cache size (generated code depends on all three), for the store key."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1]
                    break
    except OSError:
        pass
    import platform

    from .codegen import llc_bytes, machine_threads

    return (f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"
            f":{machine_threads()}cores:{llc_bytes() >> 10}KiB")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 (16 hex digits) of accel's own sources and kernel headers: a kernel or trie
    node recorded by other accel code (a new release, or a changed checkout) is never
    reused, as Inductor's ``torch_key`` does for its own sources."""
    h = hashlib.sha256()
    pkg = os.path.dirname(os.path.abspath(__file__))
    for folder, exts in ((pkg, (".py", ".pyx", ".pxi")), (os.path.join(pkg, "codegen"), (".py",)),
                         (os.path.join(INCLUDE_DIR, "accel"), (".h", ".cuh"))):
        for name in sorted(os.listdir(folder)):
            if name.endswith(exts):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


#: nvcc flags: no --use_fast_math (results must match eager); device code only, a cubin
#: for the driver API (bench/cuda_load: it loads in a tenth of a host library's time and
#: launches faster, and no host compiler runs).
NVCCFLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-cubin", "-w"]


def cuda_arch(index: int = 0) -> str:
    """nvcc's ``-arch`` for CUDA device ``index``: ``sm_90a`` on Hopper (its architecture-
    specific features), ``sm_XY`` before it.

    Raises:
        BuildError: no CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise BuildError("no CUDA device")
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


_FOUND: dict = {}


def _which(name: str):
    """``shutil.which(name)``, remembered per ``$PATH`` once found (a compiler that is
    missing is looked for again at the next call)."""
    k = (name, os.environ.get("PATH"))
    path = _FOUND.get(k)
    if path is None:
        path = shutil.which(name)
        if path is not None:
            _FOUND[k] = path
    return path


def _toolchain(device: str):
    """(compiler path, flags, libraries, source suffix, the rest of its identity)."""
    if device == "cuda":
        nvcc = config.flag("ACCEL_NVCC")
        path = _which(nvcc) or (nvcc if os.path.isabs(nvcc) and os.path.exists(nvcc) else None)
        if path is None:
            raise BuildError(f"CUDA compiler {nvcc!r} not found (set ACCEL_NVCC)")
        return path, NVCCFLAGS + ["-arch", cuda_arch()], [], ".cu", cuda_arch()
    return _cxx(), CXXFLAGS, LIBS, ".cpp", cpu_isa()


def _cxx() -> str:
    """The C++ compiler's path (``$ACCEL_CXX``).

    Raises:
        BuildError: it cannot be found.
    """
    cxx = config.flag("ACCEL_CXX")
    path = _which(cxx)
    if path is None:
        raise BuildError(f"C++ compiler {cxx!r} not found (set ACCEL_CXX)")
    return path


def compiler_key(device: str = "cpu") -> str:
    """Compiler identity and flags, and the CPU ISA or GPU architecture, as stored in every
    key of kernels for ``device`` ("cpu" or "cuda").

    Raises:
        BuildError: the compiler cannot be found (or, for "cuda", there is no GPU).
    """
    path, flags, libs, _, target = _toolchain(device)
    return f"{_identity(path)}|{' '.join(flags + libs)}|{target}"


def build(source: str, name: str, device: str = "cpu", store=None) -> bytes:
    """Compile ``source`` (C++ for "cpu", CUDA C++ for "cuda") to a shared library (a
    cubin for "cuda") and return its bytes. A CPU build for an on-disk ``store``
    (:class:`accel.store.Store`) includes the precompiled header kept there (see
    :data:`PCH_HEADER`) once it exists.

    Raises:
        BuildError: missing compiler, compile error (with the compiler's output), or a
            compile that ran past ``ACCEL_COMPILE_TIMEOUT`` seconds (it is killed).
    """
    path, flags, libs, suffix, _ = _toolchain(device)
    out = ".cubin" if device == "cuda" else ".so"

    def command(pch):
        return lambda src, lib: [path, *flags, *(("-I", pch) if pch else ()), "-I", INCLUDE_DIR,
                                 src, "-o", lib, *libs]

    key, pch = _pch_dir(store) if device == "cpu" and store is not None else (None, None)
    if pch is not None:
        try:
            return _run(path, source, name + suffix, name + out, command(pch))
        except BuildTimeout:
            raise
        except BuildError:  # below: without it; where that builds, the header was at fault
            pass
    artifact = _run(path, source, name + suffix, name + out, command(None))
    if pch is not None:
        log.warning("accel: a kernel that builds without the precompiled header %s failed with "
                    "it; this process builds without it", PCH_HEADER)
        with _pch_lock:
            _pch[key] = None
    return artifact


#: Every CPU kernel's source starts by including this header (``CppRenderer.prefix``).
#: Precompiled once into the store, it takes parsing <cmath> and accel's headers, about half
#: of a small kernel's build (0.35 -> 0.18 s on the dev VM), off every later build. gcc looks
#: for ``<header>.gch`` in each include directory before the header itself and uses it where
#: it was built with the same flags (otherwise it reads the header); a kernel built with it is
#: the same library byte for byte.
PCH_HEADER = "accel/cpu_math.h"
#: A process starts building the precompiled header at its this-many-th CPU kernel build, in
#: the background (0.6-1.7 s of a core, about as much as the builds of 4-12 kernels save):
#: one that builds a few kernels would not get it back.
PCH_AFTER_BUILDS = 4

_pch_lock = threading.Lock()
_pch: dict = {}  # store key -> this process's include directory holding the .gch, or None
_cpu_builds = 0


def pch_key() -> str:
    """The precompiled header's store key: the compiler's identity and flags, the CPU's
    instruction set and accel's sources and headers (:func:`source_hash`).

    Raises:
        BuildError: the C++ compiler cannot be found.
    """
    from .store import STORE_VERSION

    return hashlib.sha256(f"pch|{STORE_VERSION}|{compiler_key('cpu')}|{source_hash()}".encode()).hexdigest()


def _pch_dir(store) -> tuple:
    """(key, include directory holding :data:`PCH_HEADER`'s .gch) for this process's next
    CPU kernel build; the directory is None where there is none yet. The first build looks
    the header up in ``store`` (on disk only); the :data:`PCH_AFTER_BUILDS`-th, where that
    found none, starts building it there on a thread (the builds until it is done go
    without)."""
    global _cpu_builds
    if not getattr(store, "persistent", False):
        return None, None
    try:
        key = pch_key()
    except (BuildError, OSError):
        return None, None
    with _pch_lock:
        _cpu_builds += 1
        n = _cpu_builds
        if key in _pch or 1 < n < PCH_AFTER_BUILDS:
            return key, _pch.get(key)
        if n >= PCH_AFTER_BUILDS:
            _pch[key] = None  # being built
    if n < PCH_AFTER_BUILDS:  # the first build: look it up
        _find_pch(key, store, build=False)
    else:
        threading.Thread(target=_find_pch, args=(key, store), name="accel-pch", daemon=True).start()
    return key, _pch.get(key)


def _find_pch(key: str, store, build: bool = True) -> None:
    """Find the precompiled header in ``store``, or (``build``) build it there (under the
    store's compile lock: one process builds it, the others wait and read it); link it from
    a directory of this process's own (removed at exit) for the builds to include. A failed
    build is stored as a negative entry (no later process tries again); a timeout is not."""
    try:
        entry = store.get(key)
        if entry is None and build:
            with store.compile_lock(key):
                entry = store.get(key)
                if entry is None:
                    entry = _build_pch(key, store)
        if entry is None or entry.negative:
            return
        d = tempfile.mkdtemp(prefix="accel-pch-")
        atexit.register(shutil.rmtree, d, True)
        os.mkdir(os.path.join(d, "accel"))
        # the store's object, checked as the kernels' libraries are before they are loaded
        os.symlink(entry.path, os.path.join(d, PCH_HEADER + ".gch"))
        with _pch_lock:
            _pch[key] = d
    except Exception as e:  # noqa: BLE001 - builds go on without it
        log.debug("no precompiled header: %s: %s", type(e).__name__, e)


def _build_pch(key: str, store):
    """Build :data:`PCH_HEADER` with the kernels' flags into ``store``; its entry (negative
    where the compiler failed).

    Raises:
        BuildTimeout: the compiler ran past ``ACCEL_COMPILE_TIMEOUT``.
    """
    path = _cxx()
    with open(os.path.join(INCLUDE_DIR, PCH_HEADER)) as f:
        header = f.read()
    t0 = time.perf_counter()
    meta = {"readable": f"precompiled header {PCH_HEADER}"}
    try:
        artifact = _run(path, header, os.path.basename(PCH_HEADER), "header.gch",
                        lambda src, out: [path, *CXXFLAGS, "-I", INCLUDE_DIR, "-x", "c++-header",
                                          src, "-o", out])
    except BuildTimeout:
        raise
    except BuildError as e:
        store.put_negative(key, str(e), meta)
        return store.get(key)
    meta["compile_time_s"] = time.perf_counter() - t0
    log.info("built the precompiled header %s in %.2f s", PCH_HEADER, meta["compile_time_s"])
    return store.put(key, artifact, meta)


#: Popen arguments that start the compiler in a process group of its own (in the caller's
#: session, whose priority a background build lowered: accel.dispatch._lower_priority).
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the compiler's process group (the compiler and what it started), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # gone already
        pass
    proc.communicate()


#: A torch extension (the dispatch filter) builds in the background at the lowest CPU
#: priority, off the program's path, where a busy machine (a test suite on every core)
#: starves it: it gets this many times ``ACCEL_COMPILE_TIMEOUT`` (about 35 s of CPU time
#: on the 2-core dev VM; 120 s of wall time ran out there under load).
EXTENSION_TIMEOUT_SCALE = 5


#: compilers running (for a thread: the precompiled header's, ``ACCEL_ASYNC_COMPILE``'s) ->
#: their directories; a process that exits kills them and removes their directories.
_running: dict = {}


@atexit.register
def _kill_running() -> None:
    for proc, d in list(_running.items()):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def _run(path: str, source: str, src_name: str, lib_name: str, command, scale: int = 1) -> bytes:
    """Write ``source`` to ``src_name`` in a fresh directory, run ``command(src, lib)``
    (the argv of compiler ``path``) under ``scale`` times ``ACCEL_COMPILE_TIMEOUT``; the
    bytes of ``lib``.

    Raises:
        BuildError: as :func:`build`.
    """
    timeout = scale * config.flag("ACCEL_COMPILE_TIMEOUT")
    with tempfile.TemporaryDirectory(prefix="accel-build-") as d:
        src = os.path.join(d, src_name)
        lib = os.path.join(d, lib_name)
        with open(src, "w") as f:
            f.write(source)
        try:
            # a process group of its own: a timeout kills the compiler's own children too
            # (g++'s cc1plus, about 1.4 GB while it builds the dispatch filter, outlived a
            # killed g++ and piled up on a loaded machine)
            proc = subprocess.Popen(command(src, lib), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, **_OWN_GROUP)
        except OSError as e:
            raise BuildError(f"cannot run {path}: {e}") from e
        _running[proc] = d
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            _kill_group(proc)
            raise BuildTimeout(f"compile timed out after {timeout} s") from e
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            _running.pop(proc, None)
        if proc.returncode != 0 or not os.path.exists(lib):
            raise BuildError(f"{os.path.basename(path)} failed ({proc.returncode}):\n"
                             f"{(stderr or stdout)[-4000:]}")
        with open(lib, "rb") as f:
            return f.read()


#: compiler flags of a torch C++ extension (torch.utils.cpp_extension's C++ standard; OpenMP, as
#: torch is built: ATen's inline at::parallel_for runs serially without it, and the library
#: shares torch's libgomp.so.1)
TORCH_EXTENSION_FLAGS = ["-O2", "-std=c++20", "-fopenmp", "-fPIC", "-shared", "-w"]


def torch_extension_key() -> str:
    """Compiler identity, flags, torch build, its C++ ABI and Python's ABI: the store key
    part of a library built by :func:`build_torch_extension` (without importing
    ``torch.utils.cpp_extension``, which a build needs and a look-up must not pay for).

    Raises:
        BuildError: the compiler cannot be found.
    """
    import importlib.machinery

    import torch

    # the extension-module suffix names Python's ABI (".cpython-311-x86_64-linux-gnu.so":
    # sysconfig's SOABI, without the millisecond sysconfig takes to load its data)
    return (f"{_identity(_cxx())}|{' '.join(TORCH_EXTENSION_FLAGS)}|torch {torch.__version__} "
            f"{torch.version.git_version} cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
            f"|{importlib.machinery.EXTENSION_SUFFIXES[0]}")


def build_torch_extension(source: str, name: str) -> bytes:
    """Compile C++ ``source`` that uses torch's C++ API (and Python's C API) into a shared
    library for this process's torch and Python, as ``torch.utils.cpp_extension`` builds an
    extension (its include and library paths, C++ ABI; accel's headers), linking c10,
    torch_cpu and torch_python through an rpath; its bytes.

    Raises:
        BuildError: as :func:`build`.
    """
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    path = _cxx()
    flags = [*TORCH_EXTENSION_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for inc in [INCLUDE_DIR, *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]:
        flags += ["-I", inc]
    for lib in cpp_extension.library_paths():
        flags += ["-L", lib, f"-Wl,-rpath,{lib}"]
    flags += ["-lc10", "-ltorch_cpu", "-ltorch_python"]
    return _run(path, source, name + ".cpp", name + ".so",
                lambda src, lib: [path, src, "-o", lib, *flags], EXTENSION_TIMEOUT_SCALE)
