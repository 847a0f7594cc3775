# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""accel's native core: loading compiled kernels and calling them without the GIL.

The kernel ABI is declared in include/accel/kernel.h.
"""
from libc.stdint cimport int64_t, uintptr_t
from libc.stdlib cimport malloc, free
from posix.dlfcn cimport dlopen, dlsym, dlerror, RTLD_NOW, RTLD_LOCAL

cdef extern from "accel/kernel.h" nogil:
    ctypedef union accel_scalar_t:
        double f
        int64_t i
    ctypedef int (*accel_kernel_fn)(void** bufs, const accel_scalar_t* scalars)

cdef enum:
    STACK = 64


class LoadError(OSError):
    """A kernel library could not be opened or lacks its entry point."""


def load(str path, str symbol):
    """dlopen ``path`` and return the address of ``symbol`` (an int), keeping it loaded.

    Raises:
        LoadError: dlopen or dlsym failed (message from dlerror).
    """
    cdef bytes p = path.encode()
    cdef bytes s = symbol.encode()
    cdef void* h = dlopen(p, RTLD_NOW | RTLD_LOCAL)
    if h == NULL:
        raise LoadError((<bytes>dlerror()).decode(errors="replace"))
    cdef void* f = dlsym(h, s)
    if f == NULL:
        raise LoadError(f"{symbol} not found in {path}")
    return <uintptr_t>f


def launch(uintptr_t fn, list ptrs, list scalars):
    """Call kernel ``fn`` with buffer addresses ``ptrs`` (ints) and runtime ``scalars``
    (Python floats and ints), releasing the GIL for the call. Returns the kernel status."""
    cdef void* bstack[STACK]
    cdef accel_scalar_t sstack[STACK]
    cdef Py_ssize_t nb = len(ptrs), ns = len(scalars), i
    cdef void** bufs = &bstack[0] if nb <= STACK else <void**>malloc(nb * sizeof(void*))
    cdef accel_scalar_t* sc = &sstack[0] if ns <= STACK else <accel_scalar_t*>malloc(ns * sizeof(accel_scalar_t))
    cdef int status
    try:
        for i in range(nb):
            bufs[i] = <void*><uintptr_t>ptrs[i]
        for i in range(ns):
            v = scalars[i]
            if type(v) is float:
                sc[i].f = <double>v
            else:
                sc[i].i = <int64_t>v
        with nogil:
            status = (<accel_kernel_fn>fn)(bufs, sc)
    finally:
        if bufs != &bstack[0]:
            free(bufs)
        if sc != &sstack[0]:
            free(sc)
    return status
