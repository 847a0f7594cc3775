// accel's dispatch filter, its recording part: the key of a call (as the interceptor keys
// it, refined) and the trie edges the interceptor has taken, which the filter's second
// fallback (record() in include/accel/dispatch_filter.cpp) looks calls up in. The top of
// dispatch_filter.cpp says how the two fit together. Included by it alone.
#ifndef ACCEL_CALL_KEYS_H
#define ACCEL_CALL_KEYS_H

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "accel/region_view.h"

namespace accel_keys {

using c10::OperatorHandle;

// Key entries: a tag, then the entry's values.
enum Tag : int64_t {
  kTensorOut = 1, kTensorExt, kUndefined, kWrapped, kNone, kBool, kInt, kNumber, kString,
  kIntList, kDoubleList, kBoolList, kDevice, kTensorView
};

// How record() took an argument (accel/_core.pyx: _NEW_EXT, _RUNTIME, _CONSTANT).
enum Took : int { kNewExt = 0, kRuntime = 1, kConstant = 2 };

struct Check {
  int pos;
  bool is_int;
  int64_t i;
  double d;
};

// A trie edge the interceptor took: from `parent`, the call recorded as `call`, to
// `child`; the stack positions of its new external inputs and runtime scalars (in
// record()'s order) and the numbers it took as constants; whether the call runs eagerly
// instead (`child` is a small region's first call: TrieNode.eager_first). Strong
// references: edges live as long as the process (so do trie nodes).
struct Edge {
  PyObject* child;
  PyObject* call;
  PyObject* device;  // the region's device after the call (a torch.device, or None)
  std::vector<int> new_ext, runtime;
  std::vector<Check> constants;
  std::atomic<bool> eager{false};
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

inline std::mutex g_edges_mu;
inline std::unordered_map<std::vector<int64_t>, std::unique_ptr<Edge>, KeyHash> g_edges;

// A number's class: what the interceptor's key and its choice between a runtime scalar
// and a constant depend on, besides the value of a constant.
// NaN, zero (-0.0 apart from 0.0: equal as values, not in results), negative, positive
inline int64_t number_class(double d) {
  return d != d ? 3 : d == 0 ? (std::signbit(d) ? 4 : 0) : d < 0 ? 2 : 1;
}

inline bool number_like(const c10::Argument& a) {
  c10::TypePtr t = a.type();
  if (t->kind() == c10::TypeKind::OptionalType) t = t->castRaw<c10::OptionalType>()->getElementType();
  auto k = t->kind();
  return k == c10::TypeKind::NumberType || k == c10::TypeKind::FloatType;
}

// torch's own test of a default argument (parseIValuesToPyArgsKwargs: a positional
// argument at its default after which all are at theirs, or a keyword-only one at its
// default, is not passed to the mode).
inline bool is_default(const c10::Argument& a, const c10::IValue& v) {
  return a.default_value().has_value() && *a.default_value() == v;
}

inline bool wrapped_value(const at::Tensor& t, double* d, int64_t* i, int* type) {
  switch (t.scalar_type()) {
    case at::ScalarType::Double: *d = *t.const_data_ptr<double>(); *type = 0; return true;
    case at::ScalarType::Long: *i = *t.const_data_ptr<int64_t>(); *type = 1; return true;
    case at::ScalarType::Bool: *i = *t.const_data_ptr<bool>(); *type = 2; return true;
    default: return false;
  }
}

// A key entry for a sequence: its tag, its length, its elements as integers.
template <typename Seq, typename ToInt>
inline void push_list(std::vector<int64_t>* key, int64_t tag, const Seq& seq, ToInt to_int) {
  key->push_back(tag);
  key->push_back(static_cast<int64_t>(seq.size()));
  for (auto e : seq) key->push_back(to_int(e));
}

// The region core's set of storages shared outside the dispatcher (region_view.h), once
// the filter is loaded.
inline std::atomic<const accel_shared_set*> g_shared{nullptr};

// Whether `impl`'s storage is in that set (or the set is too large to look in here).
inline bool shared_storage(const c10::TensorImpl* impl) {
  const accel_shared_set* s = g_shared.load(std::memory_order_relaxed);
  int32_t n = s == nullptr ? 0 : s->n;
  if (n == 0) return false;
  if (n < 0) return true;
  const void* p = impl->storage().unsafeGetStorageImpl();
  for (int32_t i = 0; i < n; ++i) {
    if (s->storage[i] == p) return true;
  }
  return false;
}

// The key of a call to `op` from the region's current node (false: an argument the key
// cannot take, one that reads a pending output through a view, or one whose memory is
// shared outside the dispatcher, which the interceptor must see). Fills `fresh` with the
// TensorImpls of inputs new to the region, in order.
inline bool make_key(const OperatorHandle& op, const torch::jit::Stack& stack, const accel_region_view* v,
              std::vector<int64_t>* key, std::vector<const c10::TensorImpl*>* fresh) {
  const auto& args = op.schema().arguments();
  size_t n = args.size(), base = stack.size() - n;
  key->clear();
  fresh->clear();
  key->push_back(reinterpret_cast<intptr_t>(v->node));
  key->push_back(reinterpret_cast<intptr_t>(&op.schema()));
  for (size_t a = 0; a < n; ++a) {
    const c10::IValue& x = stack[base + a];
    if (x.isTensor()) {
      const at::Tensor& t = x.toTensor();
      if (!t.defined()) {
        key->push_back(kUndefined);
        continue;
      }
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (impl->_is_zerotensor()) {
        return false;  // no data to read (forward AD's tangent of a constant, say)
      }
      if (impl->is_wrapped_number()) {
        if (!impl->has_storage() || impl->storage().data() == nullptr) {
          return false;  // a transform's wrapper of one (vmap of jacfwd), with no data
        }
        double d = 0;
        int64_t i = 0;
        int type = 0;
        if (!wrapped_value(t, &d, &i, &type)) return false;
        key->insert(key->end(), {kWrapped, type, type == 2 ? i : number_class(type ? double(i) : d)});
        continue;
      }
      int j = -1;
      for (int o = 0; o < v->n_out; ++o) {
        if (v->out[o] == impl) { j = o; break; }
      }
      if (j >= 0) {
        key->insert(key->end(), {kTensorOut, j});
        continue;
      }
      if (t.layout() != at::kStrided || impl->is_nested() || !(t.is_cpu() || t.is_cuda()) ||
          !impl->has_storage() || shared_storage(impl)) {
        return false;  // (a nested tensor's layout is strided; it has no sizes)
      }
      if (v->n_out > 0) {
        intptr_t p = reinterpret_cast<intptr_t>(t.const_data_ptr());
        if (v->lo <= p && p < v->hi) {
          intptr_t b = p - t.storage_offset() * static_cast<intptr_t>(t.element_size());
          for (int o = 0; o < v->n_out; ++o) {
            if (v->out_base[o] != b) continue;
            // a view of pending output o, of its dtype (its shape, strides and offset
            // decide how accel/ops.py's pending_view reads it: through a split of the
            // output's dims or dim by dim; where it does neither, the interceptor flushes
            // the region first, and no edge is learnt from the call)
            const auto* out = static_cast<const c10::TensorImpl*>(v->out[o]);
            if (impl->dtype() != out->dtype() || !out->is_contiguous() || t.numel() == 0) return false;
            key->insert(key->end(), {kTensorView, o, t.dim(), t.storage_offset()});
            for (int64_t s : t.sizes()) key->push_back(s);
            for (int64_t s : t.strides()) key->push_back(s);
            j = o;
            break;
          }
          if (j >= 0) continue;
        }
      }
      for (int e = 0; e < v->n_ext; ++e) {
        if (v->ext[e] == impl) { j = e; break; }
      }
      if (j < 0) {
        for (size_t f = 0; f < fresh->size(); ++f) {
          if ((*fresh)[f] == impl) { j = v->n_ext + static_cast<int>(f); break; }
        }
      }
      if (j < 0) {
        j = v->n_ext + static_cast<int>(fresh->size());
        fresh->push_back(impl);
      }
      key->insert(key->end(), {kTensorExt, j, static_cast<int64_t>(t.scalar_type()),
                               static_cast<int64_t>(t.device().type()), t.device().index(),
                               t.dim(), t.storage_offset()});
      for (int64_t s : t.sizes()) key->push_back(s);
      for (int64_t s : t.strides()) key->push_back(s);
    } else if (x.isNone()) {
      key->push_back(kNone);
    } else if (x.isBool()) {
      key->insert(key->end(), {kBool, x.toBool()});
    } else if (x.isDouble()) {
      key->insert(key->end(), {kNumber, 0, number_class(x.toDouble()), is_default(args[a], x)});
    } else if (x.isInt()) {
      if (number_like(args[a])) {
        key->insert(key->end(), {kNumber, 1, number_class(double(x.toInt())), is_default(args[a], x)});
      } else {
        key->insert(key->end(), {kInt, x.toInt()});
      }
    } else if (x.isString()) {
      push_list(key, kString, x.toStringRef(), [](unsigned char c) { return int64_t{c}; });
    } else if (x.isIntList()) {
      push_list(key, kIntList, x.toIntList(), [](int64_t e) { return e; });
    } else if (x.isDoubleList()) {
      push_list(key, kDoubleList, x.toDoubleList(), [](double e) {
        int64_t bits;
        std::memcpy(&bits, &e, sizeof bits);
        return bits;
      });
    } else if (x.isBoolList()) {
      push_list(key, kBoolList, x.toBoolList(), [](bool e) { return int64_t{e}; });
    } else if (x.isDevice()) {
      key->insert(key->end(), {kDevice, static_cast<int64_t>(x.toDevice().type()), x.toDevice().index()});
    } else {
      return false;  // SymInt, Generator, complex, lists of tensors, ...
    }
  }
  return true;
}

// A number argument as the Python object the mode would have been given.
inline PyObject* number_object(const c10::IValue& x) {
  if (x.isDouble()) return PyFloat_FromDouble(x.toDouble());
  if (x.isInt()) return PyLong_FromLongLong(x.toInt());
  if (x.isTensor()) {
    double d = 0;
    int64_t i = 0;
    int type = 0;
    if (wrapped_value(x.toTensor(), &d, &i, &type)) {
      return type == 0 ? PyFloat_FromDouble(d) : type == 1 ? PyLong_FromLongLong(i) : PyBool_FromLong(i);
    }
  }
  PyErr_SetString(PyExc_TypeError, "accel: not a number");
  return nullptr;
}

// Equal, and of the same sign where both are zero (NaN is keyed by class, not checked).
inline bool same_double(double a, double b) { return a == b && std::signbit(a) == std::signbit(b); }

inline bool same_number(const c10::IValue& x, const Check& c) {
  double d = 0;
  int64_t i = 0;
  int type = 0;
  if (x.isDouble()) return !c.is_int && same_double(x.toDouble(), c.d);
  if (x.isInt()) return c.is_int && x.toInt() == c.i;
  if (x.isTensor() && wrapped_value(x.toTensor(), &d, &i, &type) && type != 2) {
    return type == 0 ? !c.is_int && same_double(d, c.d) : c.is_int && i == c.i;
  }
  return false;
}

// After the mode recorded a call whose key is `key` (the core's `last_call`), or ran it
// eagerly as a small or idle region's first call (`eager_call`, with `eager`): keep the
// edge it took, marked to run eagerly in the second case (the GIL held).
inline void learn(const OperatorHandle& op, std::vector<int64_t>&& key, const void* parent,
           accel_region_view* v, bool eager = false) {
  PyObject* last = PyObject_GetAttrString(static_cast<PyObject*>(v->region),
                                          eager ? "eager_call" : "last_call");
  if (last == nullptr) {
    PyErr_Clear();
    return;
  }
  auto edge = std::make_unique<Edge>();
  bool ok = PyTuple_Check(last) && PyTuple_GET_SIZE(last) == 4 &&
            PyTuple_GET_ITEM(last, 0) == parent &&
            (eager || PyTuple_GET_ITEM(last, 1) == v->node) &&
            PyList_Check(PyTuple_GET_ITEM(last, 3));
  edge->eager.store(eager, std::memory_order_relaxed);
  const auto& args = op.schema().arguments();
  if (ok) {
    PyObject* plan = PyTuple_GET_ITEM(last, 3);
    for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(plan); ++k) {
      PyObject* p = PyList_GET_ITEM(plan, k);
      ok = PyTuple_Check(p) && PyTuple_GET_SIZE(p) == 3;
      if (!ok) break;
      PyObject* where = PyTuple_GET_ITEM(p, 0);
      long took = PyLong_AsLong(PyTuple_GET_ITEM(p, 1));
      int pos = -1;
      if (PyLong_Check(where)) {
        pos = static_cast<int>(PyLong_AsLong(where));
      } else if (PyUnicode_Check(where)) {
        const char* name = PyUnicode_AsUTF8(where);
        for (size_t a = 0; name && a < args.size(); ++a) {
          if (args[a].name() == name) pos = static_cast<int>(a);
        }
      }
      ok = pos >= 0 && pos < static_cast<int>(args.size());
      if (!ok) break;
      if (took == kNewExt) {
        edge->new_ext.push_back(pos);
      } else if (took == kRuntime) {
        edge->runtime.push_back(pos);
      } else {
        PyObject* value = PyTuple_GET_ITEM(p, 2);
        Check c{pos, static_cast<bool>(PyLong_Check(value)), 0, 0.0};
        if (c.is_int) {
          c.i = PyLong_AsLongLong(value);
        } else {
          c.d = PyFloat_AsDouble(value);
        }
        edge->constants.push_back(c);
      }
    }
  }
  PyObject* device = ok ? PyObject_GetAttrString(static_cast<PyObject*>(v->region), "device") : nullptr;
  ok = ok && device != nullptr;
  if (ok && !PyErr_Occurred()) {
    edge->device = device;  // the reference taken
    edge->child = PyTuple_GET_ITEM(last, 1);
    edge->call = PyTuple_GET_ITEM(last, 2);
    Py_INCREF(edge->child);
    Py_INCREF(edge->call);
    std::lock_guard<std::mutex> guard(g_edges_mu);
    g_edges.emplace(std::move(key), std::move(edge));  // already there (another thread): kept
  } else {
    Py_XDECREF(device);
  }
  PyErr_Clear();
  Py_DECREF(last);
}

inline const Edge* find_edge(const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> guard(g_edges_mu);
  auto it = g_edges.find(key);
  return it == g_edges.end() ? nullptr : it->second.get();
}


}  // namespace accel_keys

#endif  // ACCEL_CALL_KEYS_H
