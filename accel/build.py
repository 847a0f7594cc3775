"""Build: compile generated C++ into a shared library with the system compiler.

Compiler discovery (``$ACCEL_CXX``, default ``g++``), flags, a timeout that kills a hung
compile, and the compiler identity that goes into every store key.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from . import config

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "include")
if not os.path.isdir(os.path.join(INCLUDE_DIR, "accel")):  # installed (non-editable) layout
    INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")

#: No -ffast-math: results must match eager. -fno-math-errno lets gcc call libmvec;
#: -fno-trapping-math (no FP exceptions are ever read: results are unchanged) lets it
#: vectorize floor and selects; -fwrapv gives integer overflow eager's wrap-around; no FMA
#: contraction (eager has none).
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
            "-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-ffp-contract=off", "-w"]
LIBS = ["-lmvec", "-lm"]


class BuildError(RuntimeError):
    """The compiler is missing, failed, or timed out (message carries its output)."""


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


def build(source: str, name: str, device: str = "cpu") -> bytes:
    """Compile ``source`` (C++ for "cpu", CUDA C++ for "cuda") to a shared library (a
    cubin for "cuda") and return its bytes.

    Raises:
        BuildError: missing compiler, compile error (with the compiler's output), or a
            compile that ran past ``ACCEL_COMPILE_TIMEOUT`` seconds (it is killed).
    """
    path, flags, libs, suffix, _ = _toolchain(device)
    out = ".cubin" if device == "cuda" else ".so"
    return _run(path, source, name + suffix, name + out,
                lambda src, lib: [path, *flags, "-I", INCLUDE_DIR, src, "-o", lib, *libs])


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
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            _kill_group(proc)
            raise BuildTimeout(f"compile timed out after {timeout} s") from e
        except BaseException:
            _kill_group(proc)
            raise
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
