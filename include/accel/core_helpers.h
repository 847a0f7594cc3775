// The region core's C++ helpers (accel/_core.pyx's set_helpers takes their addresses once
// the dispatch filter is loaded): allocating deferred outputs, their liveness at a flush and
// the written-input overlap check, each without the Python calls of its pure-Python form,
// and buffer reuse at a flush, which only C++ can do (it exchanges two storages' memory).
// Definitions, included once: by include/accel/dispatch_filter.cpp, whose library
// exports them (accel/dispatch.py hashes this file into the library's store key).
#pragma once

#include <Python.h>

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <utility>

extern "C" {

// torch.empty_strided(shape, stride, dtype=dtype, device=device) without the Python
// binding's argument parsing (about 1 us of the 1.3 a call costs on the dev VM): the region
// core allocates deferred outputs with it (the GIL held). shape, stride: tuples of ints;
// dtype: a torch.dtype; device: a torch.device, or None for the CPU. Returns a new
// reference, or null with the Python exception set (torch's, as the binding raises it).
// Unlike the binding it keeps the GIL: an allocation (CPU, or the CUDA caching allocator's)
// takes no lock that a thread waiting for the GIL could hold.
PyObject* accel_empty_strided(PyObject* shape, PyObject* stride, PyObject* dtype, PyObject* device) {
  HANDLE_TH_ERRORS
  if (!PyTuple_Check(shape) || !PyTuple_Check(stride) || !THPDtype_Check(dtype) ||
      (device != Py_None && !THPDevice_Check(device))) {
    PyErr_SetString(PyExc_TypeError, "accel_empty_strided: bad arguments");
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(shape);
  if (PyTuple_GET_SIZE(stride) != n) {
    PyErr_SetString(PyExc_ValueError, "accel_empty_strided: shape and stride differ in length");
    return nullptr;
  }
  c10::SmallVector<int64_t, 8> sizes(n), strides(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    sizes[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, k));
    strides[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, k));
  }
  if (PyErr_Occurred()) return nullptr;
  auto options = at::TensorOptions().dtype(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
  if (device != Py_None) options = options.device(reinterpret_cast<THPDevice*>(device)->device);
  return THPVariable_Wrap(at::empty_strided(sizes, strides, options));
  END_HANDLE_TH_ERRORS
}

// Which of a region's outputs are still observable (RegionCore.liveness, which calls this
// with the GIL held): a tuple, one entry per tensor of the list `outs`: True where Python
// holds it (besides the list), another TensorImpl reference exists (autograd's saved
// values, say) or two more references share its storage; False where nothing else holds
// it or its storage; None where one other reference holds its storage: another tensor (a
// view: live) or the storage's own Python object (the CPU output pool's: not live), which
// the caller tells apart. Null with a Python exception set where an element is not a tensor.
PyObject* accel_liveness(PyObject* outs) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(outs)) {
    PyErr_SetString(PyExc_TypeError, "accel_liveness: not a list");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(outs);
  PyObject* live = PyTuple_New(n);
  for (Py_ssize_t k = 0; live != nullptr && k < n; ++k) {
    PyObject* o = PyList_GET_ITEM(outs, k);
    if (!THPVariable_Check(o)) {
      Py_DECREF(live);
      PyErr_SetString(PyExc_TypeError, "accel_liveness: not a tensor");
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(o);
    size_t shared = t.storage().use_count();
    PyObject* b = Py_REFCNT(o) > 1 || t.use_count() > 1 || shared > 2 ? Py_True
                  : shared == 2 ? Py_None : Py_False;
    Py_INCREF(b);
    PyTuple_SET_ITEM(live, k, b);
  }
  return live;
  END_HANDLE_TH_ERRORS
}

// Whether an external input a region writes shares memory with another of its external
// inputs (RegionCore.spans_overlap, which calls this with the GIL held): `ext`, a list of
// tensors; `written`, a tuple of indices into it. Storages are compared by their byte
// ranges [data, data + nbytes). Returns a new reference to True or False, or null with a
// Python exception set where an element is not a tensor or an index is out of range.
PyObject* accel_ext_overlap(PyObject* ext, PyObject* written) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(ext) || !PyTuple_Check(written)) {
    PyErr_SetString(PyExc_TypeError, "accel_ext_overlap: bad arguments");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(ext);
  c10::SmallVector<std::pair<uintptr_t, uintptr_t>, 16> spans(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* o = PyList_GET_ITEM(ext, k);
    if (!THPVariable_Check(o)) {
      PyErr_SetString(PyExc_TypeError, "accel_ext_overlap: not a tensor");
      return nullptr;
    }
    const c10::Storage& s = THPVariable_Unpack(o).storage();
    uintptr_t lo = reinterpret_cast<uintptr_t>(s.data());
    spans[k] = {lo, lo + s.nbytes()};
  }
  for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(written); ++w) {
    Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(written, w));
    if (j < 0 || j >= n) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "accel_ext_overlap: index out of range");
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i != j && spans[i].first < spans[j].second && spans[j].first < spans[i].second) {
        Py_RETURN_TRUE;
      }
    }
  }
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

// Buffer reuse at a flush (RegionCore.run_cached and accel.runtime.execute call it with the
// GIL held, before a CPU kernel's buffer addresses are taken): each live output of at least
// `min_bytes` takes the memory of the earliest dead output before it with a storage of the
// same size, whose storage takes the live one's in exchange (freed with it when the region
// clears). `outs`: the region's output tensors in allocation order; `live_idx`: a tuple of
// the indices the kernel writes. A region allocates every output when its call is recorded,
// and holds the dead ones until the flush, so its last output got the block allocated last;
// in eager, where each temporary is freed as soon as it is used, the output would have
// reused a temporary's block, freed moments before and still in the cache. That is the
// block the region's earliest output of that size got (the allocator hands out the block
// freed last first). Inductor plans the same reuse at compile time (its scheduler's
// buffer reuse); here the sizes and liveness are known at the flush. Nothing outside the
// region can have seen a pending output's address (every way of reading one flushes
// first), views share the storage, and a dead output's storage is held by nothing else
// (use count 1), so the exchange is unobservable. Only plain CPU storages of one allocator.
// Returns the number of exchanges, or null with a Python exception set where `outs` is not
// a list of tensors or an index is out of range.
PyObject* accel_reuse_blocks(PyObject* outs, PyObject* live_idx, Py_ssize_t min_bytes) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(outs) || !PyTuple_Check(live_idx)) {
    PyErr_SetString(PyExc_TypeError, "accel_reuse_blocks: bad arguments");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(outs);
  c10::SmallVector<char, 32> live(n, 0);
  for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(live_idx); ++w) {
    Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(live_idx, w));
    if (j < 0 || j >= n) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "accel_reuse_blocks: index out of range");
      return nullptr;
    }
    live[j] = 1;
  }
  c10::SmallVector<c10::StorageImpl*, 16> dead;  // donors, in allocation order (null: taken)
  long swaps = 0;
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* o = PyList_GET_ITEM(outs, k);
    if (!THPVariable_Check(o)) {
      PyErr_SetString(PyExc_TypeError, "accel_reuse_blocks: not a tensor");
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.has_storage() || !t.is_cpu()) continue;
    const c10::Storage& st = t.storage();
    c10::StorageImpl* s = st.unsafeGetStorageImpl();
    if (static_cast<Py_ssize_t>(s->nbytes()) < min_bytes || !s->resizable() || s->allocator() == nullptr) continue;
    if (!live[k]) {
      if (st.use_count() == 1 && t.use_count() == 1) dead.push_back(s);
      continue;
    }
    for (auto& d : dead) {
      if (d != nullptr && d->nbytes() == s->nbytes() && d->allocator() == s->allocator()) {
        at::DataPtr mine = s->set_data_ptr(at::DataPtr());
        s->set_data_ptr(d->set_data_ptr(std::move(mine)));
        d = nullptr;
        ++swaps;
        break;
      }
    }
  }
  return PyLong_FromLong(swaps);
  END_HANDLE_TH_ERRORS
}

}  // extern "C"
