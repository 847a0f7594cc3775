"""``python -m accel ...``: the ``accel`` command line (see :mod:`accel.cli`)."""
import sys

from accel.cli import main

if __name__ == "__main__":
    sys.exit(main())
