"""The ``accel`` command: inspect the kernel store, run a script accelerated, run the demo.

Exit codes: 0 success, 1 failure (unknown key, ambiguous prefix, unusable store, missing script),
2 usage error or invalid ``ACCEL_*`` variable. ``accel run`` exits with the script's own status.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import sys

from . import config

__all__ = ["main"]


class _Fail(Exception):
    """A command failed: print the message, exit 1."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _when(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(" ", "seconds") if t else "-"


def _open_store():
    from .store import Store, StoreError

    try:
        return Store()
    except StoreError as e:
        raise _Fail(f"{e}") from None


def _resolve(store, prefix: str) -> str:
    """The one key starting with ``prefix``; _Fail if none or several."""
    keys = store.find(prefix)
    if not keys:
        raise _Fail(f"no kernel store entry matches {prefix!r}")
    if len(keys) > 1:
        shown = ", ".join(k[:16] for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
        raise _Fail(f"{prefix!r} is ambiguous: {len(keys)} entries match ({shown})")
    return keys[0]


def _cache_info(args) -> int:
    i = _open_store().info()
    rows = [("location", i["location"]),
            ("size", f"{_human(i['size_bytes'])} ({i['size_bytes']} bytes)"),
            ("entries", i["entries"]),
            ("size limit", f"{_human(i['size_limit_bytes'])} ({i['size_limit_bytes']} bytes)"),
            ("hits", i["hits"]), ("misses", i["misses"]),
            ("compiles", i["compiles"]), ("compile failures", i["compile_failures"])]
    for name, value in rows:
        print(f"{name + ':':<18}{value}")
    return 0


def _cache_list(args) -> int:
    store = _open_store()
    entries = sorted(store.entries(), key=lambda e: e["last_use"] or 0, reverse=True)
    if not entries:
        print(f"the kernel store at {store.location} is empty")
        return 0
    print(f"{'KEY':<16}  {'SIZE':>9}  {'COMPILE':>8}  {'LAST USE':<19}  READABLE")
    for e in entries:
        ct = f"{e['compile_time']:.2f} s" if e["compile_time"] is not None else "-"
        mark = "[negative] " if e["negative"] else ""
        print(f"{e['key'][:16]:<16}  {_human(e['size']):>9}  {ct:>8}  {_when(e['last_use']):<19}  "
              f"{mark}{e['readable']}")
    return 0


def _cache_inspect(args) -> int:
    store = _open_store()
    meta = store.inspect(_resolve(store, args.key))
    source = meta.pop("source", None)
    print(json.dumps(meta, indent=2, sort_keys=True, default=str))
    print("\n----- generated source -----")
    print(source if source else "(no source stored)")
    return 0


def _cache_clear(args) -> int:
    if bool(args.keys) == args.all:
        args.parser.error("give KEY prefixes or --all (not both)")
    store = _open_store()
    n = store.clear(None if args.all else sorted({_resolve(store, k) for k in args.keys}))
    print(f"removed {n} {'entry' if n == 1 else 'entries'} from {store.location}")
    return 0


def _exit_code(code) -> int:
    """What ``sys.exit(code)`` would make the process's status."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _run(args) -> int:
    script = args.script
    if not os.path.isfile(script):
        raise _Fail(f"{script}: no such file")
    from . import _preload
    from .interceptor import disable, enable

    saved = sys.argv, sys.path[:]
    sys.argv = [script, *args.args]
    _preload()  # torch is imported now: the store and the script's pool blocks, in the background
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    enable()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return _exit_code(e.code)
    finally:
        disable()  # flushes the pending region
        sys.argv, sys.path[:] = saved
    return 0


def _demo(args) -> int:
    from . import demo

    return _exit_code(demo.main(args.args))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel", description="accel: fused kernels for eager PyTorch.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    cache = sub.add_parser("cache", help="inspect or clear the kernel store",
                           description="Inspect or clear the persistent kernel store.")
    csub = cache.add_subparsers(dest="cache_command", metavar="SUBCOMMAND", required=True)
    csub.add_parser("info", help="location, size, entries, counters",
                    description="Show the store location, size, entry count, limit and counters."
                    ).set_defaults(fn=_cache_info)
    csub.add_parser("list", help="one line per entry",
                    description="List entries: key, size, compile time, last use, readable key."
                    ).set_defaults(fn=_cache_list)
    insp = csub.add_parser("inspect", help="metadata and generated source of one entry",
                           description="Print an entry's metadata as JSON, then its generated source.")
    insp.add_argument("key", metavar="KEY", help="an entry key, or a unique prefix of one")
    insp.set_defaults(fn=_cache_inspect)
    clr = csub.add_parser("clear", help="delete entries", description="Delete the given entries, or all.")
    clr.add_argument("keys", nargs="*", metavar="KEY", help="entry keys or unique prefixes")
    clr.add_argument("--all", action="store_true", help="delete every entry, object file and counter")
    clr.set_defaults(fn=_cache_clear, parser=clr)

    run = sub.add_parser("run", help="run a Python script with accel enabled",
                         description="Run SCRIPT unmodified, as `python SCRIPT ARGS...`, with accel enabled.")
    run.add_argument("script", metavar="SCRIPT", help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    run.set_defaults(fn=_run)

    demo = sub.add_parser("demo", help="run the accel demo", description="Run the accel demo.")
    demo.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of the demo")
    demo.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``accel`` command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["demo"] and argv[1:2] not in (["-h"], ["--help"]):
            args = argparse.Namespace(fn=_demo, args=argv[1:])  # REMAINDER would take "--x" for ours
        else:
            args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return _exit_code(e.code)
    try:
        config.validate_all()
        status = args.fn(args)
        sys.stdout.flush()  # a closed pipe fails here, inside the handlers below
        return status
    except BrokenPipeError:  # the reader went away (`accel cache list | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except SystemExit as e:  # parser.error() inside a command
        return _exit_code(e.code)
    except config.ConfigError as e:
        print(f"accel: {e}", file=sys.stderr)
        return 2
    except _Fail as e:
        print(f"accel: {e}", file=sys.stderr)
        return 1
