"""Codegen: loop IR -> native source. Backends differ by tables, not copies (tinygrad's
``renderer/cstyle.py``): :class:`CStyle` renders expressions from its type and op tables;
a backend subclass overrides the tables and the loop skeleton.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Dict, List

import torch

from ..loop_ir import Expr
from ..ops import HALF


class CodegenError(Exception):
    """The backend has no rendering for an op at a dtype (the region runs eagerly)."""


FLOATS = (torch.float32, torch.float64)
INTS = (torch.int32, torch.int64)


class CStyle:
    """C-family expression renderer. ``ops`` maps an IR op to a format string over its
    rendered arguments ``{0}``, ``{1}``, ...; an entry may be a dict keyed by "float",
    "int" or "bool" (the dtype class of the op's first argument)."""

    types: Dict[torch.dtype, str] = {torch.float32: "float", torch.float64: "double",
                                     torch.int32: "int32_t", torch.int64: "int64_t",
                                     torch.bool: "bool", torch.float16: "accel::f16",
                                     torch.bfloat16: "accel::bf16"}
    fn = "accel::"
    ops: Dict[str, object] = {
        "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})",
        "div": {"float": "({0} / {1})"},
        "neg": {"float": "(-{0})", "int": "(-{0})"},
        "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
        "gt": "({0} > {1})", "ge": "({0} >= {1})",
        "where": "({0} ? {1} : {2})",
        "bitwise_and": {"int": "({0} & {1})", "bool": "({0} && {1})"},
        "bitwise_or": {"int": "({0} | {1})", "bool": "({0} || {1})"},
        "bitwise_xor": {"int": "({0} ^ {1})", "bool": "({0} != {1})"},
        "bitwise_not": {"int": "(~{0})", "bool": "(!{0})"},
        "maximum": {"float": "$maximum({0}, {1})", "int": "$maximum({0}, {1})", "bool": "({0} || {1})"},
        "minimum": {"float": "$minimum({0}, {1})", "int": "$minimum({0}, {1})", "bool": "({0} && {1})"},
        "abs": {"float": "$abs({0})", "int": "$abs({0})", "bool": "{0}"},
        "sign": "$sign({0})", "signbit": "$signbit({0})", "isfinite": "$isfinite({0})",
        "shift_left": {"int": "$shift_left({0}, {1})"},
        "shift_right_arithmetic": {"int": "$shift_right_arithmetic({0}, {1})"},
        "remainder": {"float": "$remainder({0}, {1})"},
        "round": {"float": "$round({0})", "int": "{0}"},  # (eager: integers unchanged, bool raises)
        "reciprocal": {"float": "$reciprocal({0})"}, "rsqrt": {"float": "$rsqrt({0})"},
        "silu": {"float": "$silu({0})"}, "gelu_tanh": {"float": "$gelu_tanh({0})"},
        "vec_erf": {"float": "$vec_erf({0})"},  # CPU only (accel/decompositions.py: GELU's erf)
        "log_libm": {"float": "$log_libm({0})"},  # CPU only (accel/decompositions.py: xlogy's log)
        "fma": {"float": "$fma({0}, {1}, {2})"},  # accel/decompositions.py: lerp (CPU), add's alpha
        "mul_rn": {"float": "$mul_rn({0}, {1})"},  # GPU addcmul; products other kernels add
        "div_rn": {"float": "$div_rn({0}, {1})"},  # accel/decompositions.py: true divisions
        "div_floor": {"float": "$div_floor({0}, {1})"},  # CPU only (accel/decompositions.py)
        "pow": {"float": "$pow({0}, {1})", "int": "$powi({0}, {1})"},
        "gcd": {"int": "$gcd({0}, {1})"},
    }
    # float-only math functions rendered as $name(args)
    unary_math = ("exp exp2 expm1 log log2 log10 log1p sin cos tan asin acos atan sinh cosh "
                  "tanh asinh acosh atanh erf erfc erf_inv cbrt sqrt floor ceil trunc lgamma digamma").split()
    binary_math = "pow atan2 hypot fmod nextafter copysign fmax fmin".split()

    def __init__(self):
        table = dict(self.ops)
        for n in self.unary_math:
            table.setdefault(n, {"float": f"${n}({{0}})"})
        for n in self.binary_math:
            table.setdefault(n, {"float": f"${n}({{0}}, {{1}})"})
        for n in ("floor", "ceil", "trunc"):
            table[n] = {"float": f"${n}({{0}})", "int": "{0}", "bool": "{0}"}
        self.table = table

    def ctype(self, dtype) -> str:
        try:
            return self.types[dtype]
        except KeyError:
            raise CodegenError(f"dtype {dtype}") from None

    def buffer_ctype(self, dtype) -> str:
        """The C type of a buffer of ``dtype`` (its pointer's element type)."""
        return self.ctype(dtype)

    def const(self, v, dtype) -> str:
        if dtype in HALF:  # the lowering keeps 16-bit floats to loads, casts and stores
            raise CodegenError(f"a {dtype} constant")
        t = self.ctype(dtype)
        if dtype == torch.bool:
            return "true" if v else "false"
        if dtype in FLOATS:
            v = float(v)
            if math.isnan(v):
                return f"{t}(NAN)"
            if math.isinf(v):
                return f"{t}({'-' if v < 0 else ''}INFINITY)"
            return f"{t}({v!r})"
        return f"{t}(INT64_C({int(v)}))"

    def cast(self, x: str, src, dst) -> str:
        """``x`` of dtype ``src`` converted to ``dst`` as torch converts (16-bit floats by
        way of float32, as c10::Half and c10::BFloat16 do, and rounded to nearest even)."""
        if src in HALF:
            x, src = f"{self.fn}{'bf16' if src == torch.bfloat16 else 'f16'}_to_float({x})", torch.float32
            if dst == torch.float32:
                return x
        if dst in HALF:
            if src != torch.float32:
                x = f"static_cast<float>({x})"
            return f"{self.fn}float_to_{'bf16' if dst == torch.bfloat16 else 'f16'}({x})"
        if dst == torch.bool:
            return f"({x} != 0)"
        return f"static_cast<{self.ctype(dst)}>({x})"

    def op(self, e: Expr, args: List[str]) -> str:
        entry = self.table.get(e.op)
        if entry is None:
            raise CodegenError(f"no rendering for {e.op}")
        if e.dtype in HALF or any(isinstance(a, Expr) and a.dtype in HALF for a in e.args):
            raise CodegenError(f"{e.op} on a 16-bit float (the lowering computes it in float32)")
        if isinstance(entry, dict):
            first = next(a for a in e.args if isinstance(a, Expr)) if e.op != "where" else e.args[1]
            d = first.dtype
            cls = "float" if d in FLOATS else "bool" if d == torch.bool else "int"
            entry = entry.get(cls)
            if entry is None:
                raise CodegenError(f"no rendering for {e.op} on {d}")
        return entry.replace("$", self.fn).format(*args)


@functools.lru_cache(maxsize=1)
def machine_threads() -> int:
    """Physical cores of this machine (psutil), which decide whether a loop is worth running
    across threads; the thread count itself is OpenMP's (torch's) at run time."""
    import psutil

    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def llc_bytes() -> int:
    """Size in bytes of this machine's last-level cache (the highest-level data or unified
    cache Linux lists under ``/sys/devices/system/cpu/cpu0/cache``), 32 MiB where none is
    listed. Memory-bound CPU loops storing more than three quarters of it write with
    streaming stores (``codegen.cpp.STREAM_MIN_BYTES``); it is part of the store key."""
    import glob

    best = (0, 0)
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(d, "level")) as f:
                level = int(f.read())
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
        try:
            size = int(text.rstrip("KMGkmg")) * unit
        except ValueError:
            continue
        best = max(best, (level, size))
    return best[1] or 32 << 20
