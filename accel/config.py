"""accel's configuration: every flag declared once, with its name, default, env var and help.

Modelled on JAX's ``_src/config.py``: a flag is a small object that reads its environment
variable on each access (so tests can ``monkeypatch.setenv``) and validates it, raising
:class:`ConfigError` that names the variable and the values it allows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

__all__ = ["ConfigError", "Flag", "FLAGS", "flag", "cache_dir"]


class ConfigError(ValueError):
    """An ``ACCEL_*`` environment variable holds a value accel does not accept."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not valid; allowed values: 1/0, true/false, yes/no, on/off")


def _parse_int(lo: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            v = lo - 1
        if v < lo:
            raise ConfigError(f"{name}={raw!r} is not valid; allowed values: an integer >= {lo}")
        return v

    return parse


def _parse_choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise ConfigError(f"{name}={raw!r} is not valid; allowed values: {', '.join(choices)}")
        return v

    return parse


def _parse_path(name: str, raw: str) -> str:
    if not raw.strip():
        raise ConfigError(f"{name}={raw!r} is not valid; allowed values: a directory path")
    return os.path.abspath(os.path.expanduser(raw))


@dataclass(frozen=True)
class Flag:
    """One configuration flag: ``env`` is the variable, ``default`` its value when unset."""

    env: str
    default: object
    parse: Callable[[str, str], object]
    help: str

    @property
    def value(self):
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default
        return self.parse(self.env, raw)


FLAGS = {
    f.env: f
    for f in [
        Flag("ACCEL_EAGER", False, _parse_bool,
             "Accelerate the whole program: accel enables itself when Python starts."),
        Flag("ACCEL_DISABLE", False, _parse_bool,
             "Turn accel off everywhere; accel.eager() and ACCEL_EAGER become no-ops."),
        Flag("ACCEL_CACHE_DIR", None, _parse_path,
             "Kernel store directory (default $XDG_CACHE_HOME/accel or ~/.cache/accel)."),
        Flag("ACCEL_CACHE_SIZE_MB", 1024, _parse_int(1),
             "Size limit of the kernel store in MiB; least recently used entries are evicted."),
        Flag("ACCEL_MAX_REGION", 256, _parse_int(1),
             "Most aten calls deferred into one region before it is flushed."),
        Flag("ACCEL_LOG", "warning", _parse_choice("debug", "info", "warning", "error"),
             "Level of the 'accel' logger."),
        Flag("ACCEL_CXX", "g++", lambda n, r: r.strip() or "g++",
             "C++ compiler used for CPU kernels."),
        Flag("ACCEL_NVCC", "nvcc", lambda n, r: r.strip() or "nvcc",
             "CUDA compiler used for GPU kernels."),
        Flag("ACCEL_COMPILE_TIMEOUT", 120, _parse_int(1),
             "Seconds one kernel build may take before it is killed (and eager is used)."),
        Flag("ACCEL_ASYNC_COMPILE", False, _parse_bool,
             "Build missing kernels in the background, several at once (one per core, at "
             "most 8), running their regions eagerly until each is ready; "
             "accel.wait_for_compiles() waits for them."),
        Flag("ACCEL_RECOMPILE_LIMIT", 8, _parse_int(0),
             "New shapes of one region (the same calls over inputs of the same dtypes and "
             "ranks) whose kernels are built after the step of its first build; past it, "
             "or past 4 times as many shapes in all, the region runs eagerly at new shapes "
             "(shapes that keep changing: a sequence length per batch, a generation's "
             "growing cache); the shapes a first step meets past 4 times the limit are "
             "built in the next step that meets no new shape. Steps: backward passes and "
             "outermost accel.eager() blocks. 0: no limit."),
        Flag("ACCEL_GENERIC_KERNELS", True, _parse_bool,
             "On a CPU and a GPU, one kernel for every length of a region's outer loops (an "
             "optimizer's update of each parameter, a conversion of each weight, a bias + "
             "activation or a LayerNorm over a varying number of rows), those lengths "
             "taken at run time: a region of new lengths is traced, not compiled, where "
             "such a kernel exists (accel/codegen/generic.py). "
             "0: every region's kernel is built for its own sizes."),
        Flag("ACCEL_LAUNCH_AHEAD", "cuda", _parse_choice("cuda", "all", "off"),
             "Launch a region's kernel at its first call where the last flushes of regions "
             "starting there ran the same kernel, so that on a GPU it runs while the host "
             "records the rest of the region; kept only if the region ends as predicted with "
             "the same inputs, scalars and liveness, run again otherwise. cuda: on GPUs; "
             "all: on CPUs as well (no faster there; for testing); off."),
        Flag("ACCEL_LAUNCH_AHEAD_MIN_MB", 64, _parse_int(0),
             "Launch ahead only the kernels of regions that read and write at least this "
             "many MiB: launching ahead costs the host about 30 us (predicting the region's "
             "end at each flush, checking its inputs at the first call), more than a smaller "
             "kernel runs on a GPU, so below it launching ahead only slows a host-bound "
             "program. Read at each enable."),
        Flag("ACCEL_EAGER_SMALL_REGIONS", True, _parse_bool,
             "Run eagerly a region that was small when it first flushed (at most 3 calls, "
             "reading and writing under 64 KiB on a CPU or 16 MiB on a GPU), building no "
             "kernel for it, and from then on the call it began with: recording and flushing "
             "it costs the host more than its calls cost eager, and fusing it saves the "
             "device less. Read at each enable; 0: fuse every region."),
        Flag("ACCEL_EAGER_IDLE_REGIONS", True, _parse_bool,
             "On a GPU, run eagerly the first call of regions whose flushes found the GPU "
             "idle (done with all the work queued before them) 4 times in a row: the "
             "program is bound by the host there, which recording and flushing a region "
             "costs more than running its calls eagerly, and fusing them saves GPU time that "
             "nothing waits for. One flush that finds the GPU busy keeps them fused. Needs "
             "ACCEL_EAGER_SMALL_REGIONS. Read at each enable; 0: keep them."),
        Flag("ACCEL_STEP_SAMPLING", "all", _parse_choice("all", "cpu", "off"),
             "Time each thread's steps (between backward calls; else outermost "
             "accel.eager() blocks) with and without interception, now and then, and run "
             "them without it, as plain eager PyTorch, where that was faster (a program "
             "bound by the host, whose regions cost more to record than they save); see "
             "accel/sampling.py. all: CPU and GPU programs (GPU steps timed by CUDA "
             "events); cpu: only while the process has not initialized CUDA; off: always "
             "intercept. Read at each enable."),
        Flag("ACCEL_REMAT", "auto", _parse_choice("auto", "on", "off"),
             "Recompute in the backward the values autograd saves from a region that "
             "pointwise calls compute from other saved values (a tanh-GELU's), instead of "
             "writing them in the forward and reading them back (accel/remat.py). auto: CPU "
             "regions; on: every device; off: save them as eager does. Read at each enable."),
        Flag("ACCEL_CUDA_HALF", True, _parse_bool,
             "Run float16/bfloat16 regions on CUDA GPUs as kernels (off: eagerly, an escape "
             "hatch). Read at each enable."),
        Flag("ACCEL_DISPATCH_FILTER", True, _parse_bool,
             "Run in C++, past accel's dispatch mode, the aten calls it passes through "
             "unchanged (matmuls, views, ...; a pending region flushed first), and record "
             "there the deferred calls recorded the same way before: a torch extension built "
             "in the background at first use and kept in the store. 0: every call crosses "
             "into Python."),
        Flag("ACCEL_CPU_MATMUL", "auto", _parse_choice("auto", "on", "off"),
             "Run float32 CPU mm, addmm and bmm (the calls the dispatch filter runs past the "
             "mode) with accel's AVX-512 matmul kernel instead of eager's MKL sgemm. auto: on "
             "AMD CPUs from Zen 5 on (family 0x1A), where MKL takes a generic path at about "
             "half their speed (on Zen 4, which runs AVX-512 on 256-bit units, that path is "
             "as fast, and on Intel CPUs MKL's own AVX-512 kernels are faster: eager's); on: on "
             "any CPU with AVX-512F; off: eager's. Needs the dispatch filter; read at each "
             "enable."),
        Flag("ACCEL_PURE_PYTHON", False, _parse_bool,
             "Use the pure-Python twin of the Cython core (debugging; slower)."),
        Flag("ACCEL_CPU_POOL", "auto", _parse_choice("auto", "on", "off"),
             "Take regions' large CPU outputs from a pool of reused blocks, so that a fresh "
             "output does not page-fault. auto: where the process's malloc maps each large "
             "block afresh (glibc's defaults: ACCEL_MALLOC_TUNING=0 and no MALLOC_* "
             "tuning); elsewhere the heap already reuses freed memory, and at each flush a "
             "region's live outputs take its dead intermediates' blocks instead (buffer "
             "reuse). on: always; off: never. Read at each enable."),
        Flag("ACCEL_CPU_POOL_MB", 1024, _parse_int(0),
             "Most MiB of reused blocks (in use or free) the output pool keeps; 0 turns the "
             "pool off. accel.empty_cache() releases the free ones. Read at each enable."),
        Flag("ACCEL_MALLOC_TUNING", True, _parse_bool,
             "Keep freed memory in glibc's heap (no mmap for large blocks, no trimming), so "
             "fresh outputs do not page-fault; set once, for the whole process, at `import "
             "accel` where torch was imported first (else at the first enable). The process's "
             "resident memory then stays at its peak."),
    ]
}


def flag(env: str):
    """Return the current, validated value of the flag named ``env``.

    Raises:
        ConfigError: the variable is set to a value the flag does not allow.
        KeyError: ``env`` is not an accel flag.
    """
    return FLAGS[env].value


_FLAG_KEYS = [os.fsencode(name) if os.name != "nt" else name for name in FLAGS]
_validated = None  # the environment fingerprint of the last successful validate_all()
_values: dict = {}  # every flag's value under that fingerprint


def current() -> dict:
    """Every flag's current, validated value (name -> value), as :func:`flag` gives them;
    parsed again only when the environment changed (see :func:`validate_all`).

    Raises:
        ConfigError: an ``ACCEL_*`` variable is unknown or holds an invalid value.
    """
    validate_all()
    return _values


def validate_all() -> None:
    """Validate every ``ACCEL_*`` variable in the environment (a full scan only when the
    number of variables or an accel variable changed since the last call that passed).

    Raises:
        ConfigError: an ``ACCEL_*`` variable is unknown or holds an invalid value.
    """
    global _validated, _values
    data = getattr(os.environ, "_data", None)  # CPython's os.environ keeps a dict of bytes
    if isinstance(data, dict):
        get = data.get
        fingerprint = (len(data), *map(get, _FLAG_KEYS))
    else:
        get = os.environ.get
        fingerprint = (len(os.environ), *map(get, FLAGS))
    if fingerprint == _validated:
        return
    for name in os.environ:
        if name.startswith("ACCEL_"):
            if name not in FLAGS:
                raise ConfigError(f"{name} is not an accel variable; known: {', '.join(sorted(FLAGS))}")
            FLAGS[name].value
    _values = {name: f.value for name, f in FLAGS.items()}
    _validated = fingerprint


def cache_dir() -> str:
    """The kernel store directory: $ACCEL_CACHE_DIR, else $XDG_CACHE_HOME/accel, else ~/.cache/accel."""
    d = flag("ACCEL_CACHE_DIR")
    if d:
        return d
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "accel")
