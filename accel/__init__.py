"""accel: makes unmodified PyTorch eager programs fast.

Under ``with accel.eager():`` (or ``ACCEL_EAGER=1``, or ``accel run script.py``) aten calls
are intercepted, runs of fusible calls are deferred into regions, and each region runs as
one generated native kernel, compiled once and kept in a persistent store.
"""
__version__ = "0.1.0"

from .config import ConfigError  # noqa: E402
from .interceptor import disable, eager, enable, flush, is_enabled  # noqa: E402
from .runtime import reset_stats, stats  # noqa: E402

__all__ = ["eager", "enable", "disable", "flush", "is_enabled", "stats", "reset_stats",
           "ConfigError", "__version__"]
