"""Imported at interpreter start-up (via accel-eager.pth) when ACCEL_EAGER is set: turns
accel on for the main thread of an unmodified script. An invalid ACCEL_* value stops the
program with a message naming the variable."""
import sys

from .config import ConfigError

try:
    from .interceptor import enable

    enable()
except ConfigError as e:
    sys.stderr.write(f"accel: {e}\n")
    raise SystemExit(2)
