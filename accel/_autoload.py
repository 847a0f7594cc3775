"""Imported at interpreter start-up (via accel-eager.pth) when ACCEL_EAGER is set: turns
accel on for the main thread of an unmodified script. An invalid ACCEL_* value stops the
program with a message naming the variable."""
import os
import sys

from .config import ConfigError

try:
    from . import _preload
    from .interceptor import enable

    _preload()  # torch is imported now: the store and the pool's blocks in the background
    enable()
except ConfigError as e:
    sys.stderr.write(f"accel: {e}\n")
    sys.stderr.flush()
    os._exit(2)  # SystemExit during site start-up is a fatal interpreter error
