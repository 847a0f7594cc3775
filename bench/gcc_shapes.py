"""Regions whose CPU loops gcc 12 left scalar until the seventy-ninth round (bool masks; a
sin and a cos of one value), the eightieth (clamps, float16 selects, bool row maxima), the
eighty-first (``round``), the eighty-third (``fmod`` and what takes one, ``nextafter``) or
the eighty-fourth (``lgamma``, ``digamma``): eager, accel and torch.compile side by side (median ms per
call, interleaved, results checked).

    python bench/gcc_shapes.py [cpu|cuda] [--runs N] [--only NAME,...]

Inputs: ``x`` float32 of the device's workload shape ([8192, 1024] on the CPU, [16384, 4096]
on a GPU), ``m`` a bool mask of it (90 % true), ``b`` bools of [2, 65536] read at every
other column, ``h`` float16 of ``x``. Workloads:

- ``dropout_bwd``: ``x * m * 1.1111`` (dropout's backward);
- ``where``: ``torch.where(m, x, 0.0)``;
- ``masked_softmax``: ``x.masked_fill(~m, -1e4).softmax(-1)`` (an attention mask);
- ``mask_and``: ``m & (x > 0)``;
- ``mask_mean``: ``m.float().mean(1)`` (a per-row accuracy);
- ``masked_sum``: ``(x * m).sum(1)``;
- ``bool_log_softmax``: ``log_softmax(b[:, ::2] + 0.5, 1)``;
- ``sin_cos``: ``torch.sin(x) * 2 + torch.cos(x)``;
- ``clamp``: ``(x * 2).clamp(-1, 1)``; ``hardtanh``: ``F.hardtanh(x * 3)``;
- ``f16_where``: ``torch.where(h > 0, h, h * 2)``; ``f16_logit``: ``torch.logit(h.sigmoid(),
  1e-6)``; ``f16_smooth_l1``: ``F.smooth_l1_loss(h, h * 0.5, reduction="none")``;
- ``row_any``: ``(x > 1).amax(1)`` (bools' row maximum);
- ``round``: ``torch.round(x * 3.5)``; ``round_decimals``: ``torch.round(x * 3,
  decimals=2)``; ``f16_round``: ``torch.round(h * 3.5) - h``;
- ``fmod``: ``torch.fmod(x * 8, x + 3)``; ``remainder``: ``torch.remainder(x * 8, x + 3)``;
  ``floor_div``: ``torch.div(x * 8, x + 3, rounding_mode="floor")``; ``nextafter``:
  ``torch.nextafter(x * 2, x)``; ``fmod_f64``: ``fmod`` of ``x`` as float64;
- ``lgamma``: ``torch.lgamma(x * 4)``; ``lgamma_f64``: the same of ``x`` as float64;
  ``digamma``, ``digamma_f64``: ``torch.digamma(x * 4)`` likewise.

gcc 12 vectorized no loop that loads a bool (accel's bool buffers were ``bool*``; now
``uint8_t*``), and it joined a sin and a cos of one value into a call of glibc's scalar
sincos (now the cos is ``accel::cos_apart``): see ``accel.codegen.cpp.CppRenderer``. Two of
its passes before the vectorizer undid the if-conversion of selects (``-fno-tree-pre
-fno-tree-sink`` now: ``accel.build.CXXFLAGS``), and it vectorized no ``||`` reduction (a
bool row maximum now accumulates in an ``int``: ``accel.codegen.cpp_groups``). It vectorizes
no ``roundeven``, which every ``torch.round`` called until the eighty-first round (now
``rint``: include/accel/cpu_math.h). glibc's ``fmodf``, ``fmod`` and ``nextafterf`` have no
vector variants: accel's own are include/accel/vector_fmod.h's and cpu_math.h's
``nextafter`` (eighty-third round); nor have ``lgammaf`` and ``lgamma``, and ``digamma``'s
recurrence was a loop (eager's is scalar too): accel's own are cpu_math.h's (eighty-fourth).
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KERNELS_HEAD, compare_kernels, device_workloads_args, run_as, table  # noqa: E402

WORKLOADS = {
    "dropout_bwd": lambda x, m, b, h: x * m * 1.1111,
    "where": lambda x, m, b, h: torch.where(m, x, 0.0),
    "masked_softmax": lambda x, m, b, h: x.masked_fill(~m, -1e4).softmax(-1),
    "mask_and": lambda x, m, b, h: m & (x > 0),
    "mask_mean": lambda x, m, b, h: m.float().mean(1),
    "masked_sum": lambda x, m, b, h: (x * m).sum(1),
    "bool_log_softmax": lambda x, m, b, h: torch.log_softmax(b[:, ::2] + 0.5, 1),
    "sin_cos": lambda x, m, b, h: torch.sin(x) * 2 + torch.cos(x),
    "clamp": lambda x, m, b, h: (x * 2).clamp(-1, 1),
    "hardtanh": lambda x, m, b, h: F.hardtanh(x * 3),
    "f16_where": lambda x, m, b, h: torch.where(h > 0, h, h * 2),
    "f16_logit": lambda x, m, b, h: torch.logit(h.sigmoid(), 1e-6),
    "f16_smooth_l1": lambda x, m, b, h: F.smooth_l1_loss(h, h * 0.5, reduction="none"),
    "row_any": lambda x, m, b, h: (x > 1).amax(1),
    "round": lambda x, m, b, h: torch.round(x * 3.5),
    "round_decimals": lambda x, m, b, h: torch.round(x * 3, decimals=2),
    "f16_round": lambda x, m, b, h: torch.round(h * 3.5) - h,
    "fmod": lambda x, m, b, h: torch.fmod(x * 8, x + 3),
    "remainder": lambda x, m, b, h: torch.remainder(x * 8, x + 3),
    "floor_div": lambda x, m, b, h: torch.div(x * 8, x + 3, rounding_mode="floor"),
    "nextafter": lambda x, m, b, h: torch.nextafter(x * 2, x),
    "fmod_f64": lambda x, m, b, h: torch.fmod(x.double() * 8, x.double() + 3),
    "lgamma": lambda x, m, b, h: torch.lgamma(x * 4),
    "lgamma_f64": lambda x, m, b, h: torch.lgamma(x.double() * 4),
    "digamma": lambda x, m, b, h: torch.digamma(x * 4),
    "digamma_f64": lambda x, m, b, h: torch.digamma(x.double() * 4),
}


def main() -> None:
    dev, shape, sync, runs, wanted = device_workloads_args(__doc__)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dev)
    m = (torch.rand(*shape, generator=g) > 0.1).to(dev)
    b = (torch.rand(2, 65536, generator=g) > 0.5).to(dev)
    h = x.half()
    rows = []
    for name, fn in WORKLOADS.items():
        if not wanted(name):
            continue
        compiled = torch.compile(fn)

        def call(kind, f):
            return lambda: run_as(kind, f, (x, m, b, h), sync)

        rows.append(compare_kernels(name, call("eager", fn), call("accel", fn),
                                    call("compile", compiled), runs))
    print(table(KERNELS_HEAD, rows))


if __name__ == "__main__":
    main()
