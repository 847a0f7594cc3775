"""Which CPU kernels in an accel store gcc left scalar: every CPU kernel source the store
holds, compiled to assembly with accel's own flags (``accel.build.CXXFLAGS``); a kernel with
an ``omp simd`` loop of 16 or more iterations (or a run-time length) whose region functions
hold no 256- or 512-bit instruction is listed, with its readable name.

    ACCEL_CACHE_DIR=<a store, e.g. one a test-suite run filled> python bench/vector_audit.py [--jobs N]

``-fopt-info-vec`` is not enough: for a loop loading a ``bool`` gcc 12 reported "loop
vectorized" and emitted scalar code only (seventy-ninth round). Output: the counts, then
one line per scalar kernel (sorted by name), on stdout.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from accel.build import CXXFLAGS, INCLUDE_DIR
from accel.store import Store

SIMD_LOOP = re.compile(r"#pragma omp .*simd")
STATIC_TRIP = re.compile(r"< (\d+);")
LABEL = re.compile(r"^[A-Za-z_.$][\w.$]*:$")
WIDE = re.compile(r"%[yz]mm")


def sources(store: Store) -> dict:
    """Distinct CPU kernel sources (the entry point's name aside) -> readable name."""
    out = {}
    for e in store.entries():
        meta = store.inspect(e["key"])
        src = meta.get("source")
        if src and meta.get("device") == "cpu":
            out.setdefault(re.sub(r"accel_region_[0-9a-f]+", "accel_region", src), meta.get("readable", ""))
    return out


def long_simd_loop(src: str) -> bool:
    lines = src.splitlines()
    for i, line in enumerate(lines):
        if SIMD_LOOP.search(line):
            loop = next((x for x in lines[i + 1:] if x.strip().startswith("for")), "")
            m = STATIC_TRIP.search(loop)
            if m is None or int(m.group(1)) >= 16:
                return True
    return False


def wide_instructions(src: str, tmp: str) -> int:
    """256- and 512-bit instructions in the kernel's own functions (not the header's helpers)."""
    path = os.path.join(tmp, f"k{abs(hash(src))}.cpp")
    with open(path, "w") as f:
        f.write(src)
    flags = [x for x in CXXFLAGS if x not in ("-shared", "-w")]
    asm = subprocess.run(["g++", *flags, "-I", INCLUDE_DIR, "-S", path, "-o", "-"],
                         capture_output=True, text=True, check=True).stdout
    fn, n = "", 0
    for line in asm.splitlines():
        if LABEL.match(line) and not line.startswith(".L"):
            fn = line[:-1]
        elif "accel_region" in fn and WIDE.search(line):
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    srcs = {s: r for s, r in sources(Store()).items() if long_simd_loop(s)}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        counts = list(pool.map(lambda s: wide_instructions(s, tmp), srcs))
    scalar = sorted(r for (s, r), n in zip(srcs.items(), counts) if n == 0)
    print(f"{len(srcs)} CPU kernels with a long simd loop; {len(scalar)} without a vector instruction")
    for r in scalar:
        print(" ", r[:160])


if __name__ == "__main__":
    sys.exit(main())
