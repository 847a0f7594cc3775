# Included by accel/_core.pyx (one extension module, its two halves in two files): loading
# compiled kernels and calling them, CPU libraries through dlopen and CUDA cubins through
# the driver API. The kernel ABI is declared in include/accel/kernel.h.

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


cdef struct Args:
    void** bufs
    accel_scalar_t* sc
    void* bstack[STACK]
    accel_scalar_t sstack[STACK]


cdef int _pack(Args* a, list ptrs, list scalars) except -1:
    """Fill ``a`` with the buffer addresses and scalars (on its stack arrays, or malloc'd
    past STACK of either: :func:`_unpack` frees them)."""
    cdef Py_ssize_t nb = len(ptrs), ns = len(scalars), i
    a.bufs = &a.bstack[0] if nb <= STACK else <void**>malloc(nb * sizeof(void*))
    a.sc = &a.sstack[0] if ns <= STACK else <accel_scalar_t*>malloc(ns * sizeof(accel_scalar_t))
    if a.bufs == NULL or a.sc == NULL:
        _unpack(a)
        raise MemoryError()
    try:
        for i in range(nb):
            a.bufs[i] = <void*><uintptr_t>ptrs[i]
        for i in range(ns):
            v = scalars[i]
            if type(v) is float:
                a.sc[i].f = <double>v
            else:
                a.sc[i].i = <int64_t>v
    except BaseException:
        _unpack(a)
        raise
    return 0


cdef void _unpack(Args* a) noexcept:
    if a.bufs != &a.bstack[0]:
        free(a.bufs)
    if a.sc != &a.sstack[0]:
        free(a.sc)
    a.bufs, a.sc = &a.bstack[0], &a.sstack[0]


def launch(uintptr_t fn, list ptrs, list scalars):
    """Call CPU kernel ``fn`` with buffer addresses ``ptrs`` (ints) and runtime ``scalars``
    (Python floats and ints), releasing the GIL for the call. Returns the kernel status
    (0: success)."""
    cdef Args a
    cdef int status
    a.bufs, a.sc = &a.bstack[0], &a.sstack[0]
    _pack(&a, ptrs, scalars)
    with nogil:
        status = (<accel_kernel_fn>fn)(a.bufs, a.sc)
    _unpack(&a)
    return status


# -- CUDA: a region's cubin through the driver API (pure-Python twin: accel/_core_py.py) -----
# libcuda.so.1 is opened at first use, so the core builds and imports without CUDA.
ctypedef int CUresult
ctypedef void* CUcontext
ctypedef void* CUmodule
ctypedef void* CUfunction
ctypedef CUresult (*cuInit_t)(unsigned int) noexcept nogil
ctypedef CUresult (*cuDeviceGet_t)(int*, int) noexcept nogil
ctypedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext*, int) noexcept nogil
ctypedef CUresult (*cuCtxGetCurrent_t)(CUcontext*) noexcept nogil
ctypedef CUresult (*cuCtxSetCurrent_t)(CUcontext) noexcept nogil
ctypedef CUresult (*cuModuleLoadData_t)(CUmodule*, const void*) noexcept nogil
ctypedef CUresult (*cuModuleGetFunction_t)(CUfunction*, CUmodule, const char*) noexcept nogil
ctypedef CUresult (*cuLaunchKernel_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                      unsigned, unsigned, void*, void**, void**) noexcept nogil
ctypedef CUresult (*cuGetErrorString_t)(CUresult, const char**) noexcept nogil

cdef cuInit_t cuInit = NULL
cdef cuDeviceGet_t cuDeviceGet = NULL
cdef cuDevicePrimaryCtxRetain_t cuDevicePrimaryCtxRetain = NULL
cdef cuCtxGetCurrent_t cuCtxGetCurrent = NULL
cdef cuCtxSetCurrent_t cuCtxSetCurrent = NULL
cdef cuModuleLoadData_t cuModuleLoadData = NULL
cdef cuModuleGetFunction_t cuModuleGetFunction = NULL
cdef cuLaunchKernel_t cuLaunchKernel = NULL
cdef cuGetErrorString_t cuGetErrorString = NULL

cdef enum:
    MAX_DEVICES = 64
    CUDA_ERROR_INVALID_DEVICE = 101


cdef void* _sym(void* h, const char* name) except NULL:
    cdef void* f = dlsym(h, name)
    if f == NULL:
        raise LoadError(f"libcuda.so.1 lacks {name.decode()}")
    return f


cdef int _open_driver() except -1:
    """Resolve the driver API entry points accel uses (once)."""
    global cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxGetCurrent, cuCtxSetCurrent
    global cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel, cuGetErrorString
    if cuLaunchKernel != NULL:
        return 0
    cdef void* h = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_LOCAL)
    if h == NULL:
        raise LoadError("CUDA driver not found: " + (<bytes>dlerror()).decode(errors="replace"))
    cuDeviceGet = <cuDeviceGet_t>_sym(h, b"cuDeviceGet")
    cuDevicePrimaryCtxRetain = <cuDevicePrimaryCtxRetain_t>_sym(h, b"cuDevicePrimaryCtxRetain")
    cuCtxGetCurrent = <cuCtxGetCurrent_t>_sym(h, b"cuCtxGetCurrent")
    cuCtxSetCurrent = <cuCtxSetCurrent_t>_sym(h, b"cuCtxSetCurrent")
    cuModuleLoadData = <cuModuleLoadData_t>_sym(h, b"cuModuleLoadData")
    cuModuleGetFunction = <cuModuleGetFunction_t>_sym(h, b"cuModuleGetFunction")
    cuGetErrorString = <cuGetErrorString_t>_sym(h, b"cuGetErrorString")
    cuInit = <cuInit_t>_sym(h, b"cuInit")
    cdef CUresult r = cuInit(0)
    if r != 0:
        raise LoadError(f"cuInit failed ({r})")
    cuLaunchKernel = <cuLaunchKernel_t>_sym(h, b"cuLaunchKernel")
    return 0


def cuda_error_string(int status):
    """The CUDA driver's name for error code ``status`` (e.g. "an illegal memory access
    was encountered"), or the number where the driver does not know it."""
    cdef const char* s = NULL
    if cuGetErrorString != NULL and cuGetErrorString(status, &s) == 0 and s != NULL:
        return (<bytes>s).decode(errors="replace")
    return f"CUDA error {status}"


cdef struct LaunchStep:
    unsigned grid[3]
    unsigned block[3]
    unsigned vgrid[3]
    unsigned vblock[3]
    uint64_t vmask     # buffers that must be 16-byte aligned for the vector variant
    bint vector        # a vector variant exists


cdef class CudaKernel:
    """A region's CUDA module: its cubin image and launch plan (see
    :meth:`accel.codegen.cuda.CudaRenderer.render`), loaded into a device's primary context
    at its first launch there (``cuModuleLoadData``), then launched with ``cuLaunchKernel``.

    Raises:
        LoadError: no CUDA driver (``libcuda.so.1``).
        KeyError: a launch without its "grid", "block" or "kernel".
    """

    cdef bytes image
    cdef list names
    cdef Py_ssize_t n
    cdef LaunchStep* steps
    cdef CUfunction* funcs[MAX_DEVICES]  # per device: (scalar, vector) kernel per step
    cdef CUcontext ctxs[MAX_DEVICES]

    def __cinit__(self, bytes image, list launches):
        _open_driver()
        self.image = image
        self.n = len(launches)
        self.steps = <LaunchStep*>calloc(max(1, self.n), sizeof(LaunchStep))
        self.names = []
        cdef LaunchStep* st
        for i, l in enumerate(launches):
            st = &self.steps[i]
            for d in range(3):
                st.grid[d], st.block[d] = l["grid"][d], l["block"][d]
            v = l.get("vector")
            if v is not None and all(0 <= b < 64 for b in v["buffers"]):
                st.vector = True
                for d in range(3):
                    st.vgrid[d], st.vblock[d] = v["grid"][d], v["block"][d]
                for b in v["buffers"]:
                    st.vmask |= (<uint64_t>1) << b
                self.names += [l["kernel"].encode(), v["kernel"].encode()]
            else:
                self.names += [l["kernel"].encode(), None]

    def __dealloc__(self):
        free(self.steps)
        for i in range(MAX_DEVICES):
            free(self.funcs[i])  # modules stay loaded: the primary context outlives us

    cdef int _load(self, int device) except -1:
        cdef int dev
        cdef CUcontext ctx, prev
        cdef CUmodule mod
        cdef CUresult r = cuDeviceGet(&dev, device)
        if r == 0:
            r = cuDevicePrimaryCtxRetain(&ctx, dev)
        if r != 0:
            return r
        cuCtxGetCurrent(&prev)
        cuCtxSetCurrent(ctx)
        r = cuModuleLoadData(&mod, <const char*>self.image)
        cdef CUfunction* f = <CUfunction*>calloc(2 * max(1, self.n), sizeof(CUfunction))
        for i in range(2 * self.n):
            if r == 0 and self.names[i] is not None:
                r = cuModuleGetFunction(&f[i], mod, <const char*>self.names[i])
        cuCtxSetCurrent(prev)
        if r != 0:
            free(f)
            return r
        self.ctxs[device] = ctx
        self.funcs[device] = f
        return 0

    def launch(self, list ptrs, list scalars, uintptr_t stream, int device):
        """Launch the plan's kernels in order on ``stream`` (a CUstream of GPU ``device``)
        with buffer addresses ``ptrs`` and runtime ``scalars``, without waiting for the GPU.
        Returns 0 or the first CUresult that failed (the region then runs eagerly)."""
        cdef Args a
        cdef void* params[2]
        cdef void** bufs
        cdef Py_ssize_t i, b, nb = len(ptrs)
        cdef int status = 0
        cdef CUcontext prev
        cdef LaunchStep* st
        cdef uintptr_t addr
        cdef unsigned* g
        cdef unsigned* blk
        cdef bint vec
        if device < 0 or device >= MAX_DEVICES:
            return CUDA_ERROR_INVALID_DEVICE
        if self.funcs[device] == NULL:
            status = self._load(device)
            if status != 0:
                return status
        a.bufs, a.sc = &a.bstack[0], &a.sstack[0]
        _pack(&a, ptrs, scalars)
        bufs = a.bufs
        params[0] = <void*>a.bufs
        params[1] = <void*>a.sc
        with nogil:
            cuCtxGetCurrent(&prev)
            if prev != self.ctxs[device]:
                cuCtxSetCurrent(self.ctxs[device])
            for i in range(self.n):
                st = &self.steps[i]
                addr = 0
                if st.vector:
                    for b in range(min(nb, 64)):
                        if (st.vmask >> b) & 1:
                            addr |= <uintptr_t>bufs[b]
                vec = st.vector and (addr & 15) == 0
                if vec:
                    g, blk = &st.vgrid[0], &st.vblock[0]
                else:
                    g, blk = &st.grid[0], &st.block[0]
                status = cuLaunchKernel(self.funcs[device][2 * i + vec], g[0], g[1], g[2],
                                        blk[0], blk[1], blk[2], 0, <void*>stream, params, NULL)
                if status != 0:
                    break
            if prev != self.ctxs[device]:
                cuCtxSetCurrent(prev)
        _unpack(&a)
        return status
