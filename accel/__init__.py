"""accel: makes unmodified PyTorch eager programs fast.

Under ``with accel.eager():`` (or ``ACCEL_EAGER=1``, or ``accel run script.py``) aten calls
are intercepted, runs of fusible calls are deferred into regions, and each region runs as
one generated native kernel, compiled once and kept in a persistent store.

Attributes load lazily (PEP 562), so ``accel cache ...`` does not import torch.
"""
__version__ = "0.1.0"

from .config import ConfigError  # noqa: E402

_LAZY = {"eager": "interceptor", "enable": "interceptor", "disable": "interceptor",
         "flush": "interceptor", "is_enabled": "interceptor", "stats": "runtime",
         "reset_stats": "runtime", "wait_for_compiles": "runtime",
         "empty_cache": "allocator"}

__all__ = ["eager", "enable", "disable", "flush", "is_enabled", "stats", "reset_stats",
           "wait_for_compiles", "empty_cache", "ConfigError", "__version__"]


def _preload() -> None:
    """With torch already imported (a real program), do now what the first accelerated call
    would otherwise: import the hot path's modules, tune glibc's malloc
    (``ACCEL_MALLOC_TUNING``, so that the program's first eager iteration already leaves its
    freed memory in the heap for accel's first one), and open an existing kernel store and
    find the dispatch filter in it in the background (:func:`accel.dispatch.prefetch`).
    The CLI, without torch, stays light. Never raises: an invalid ``ACCEL_*`` value is
    reported by the first enable."""
    import sys

    if "torch" in sys.modules:
        from . import allocator, build, config, dispatch, interceptor, ops, runtime, store  # noqa: F401

        ops.fusible_ops()
        try:
            build.compiler_key()
        except build.BuildError:
            pass  # reported when a kernel is needed
        try:
            tune = not config.flag("ACCEL_DISABLE") and config.flag("ACCEL_MALLOC_TUNING")
        except config.ConfigError:
            tune = False
        if tune:
            allocator.tune_allocator()
        dispatch.prefetch()


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"accel.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


_preload()
