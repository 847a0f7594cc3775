// accel's dispatch filter: C++ in front of the interceptor's TorchDispatchMode.
//
// A dispatch mode sees every aten call by crossing into Python (torch's Python key), and
// re-dispatching a call from Python costs more than most calls themselves: in a model's
// step, most calls are ones accel never defers (matmuls, views, embedding, ...), made
// while no region is pending. This library registers a boxed fallback on a mode dispatch
// key above autograd; while accel is enabled the key is in the thread's included set
// (accel/dispatch.py), so the fallback sees each call first and either
//
//   * passes it on as usual (the Python key stays in the key set: the mode decides), or
//   * runs it past the mode: the Python keys are removed from the call's key set, and
//     excluded for the calls made inside it, exactly as inside the mode's
//     __torch_dispatch__, where the mode is popped while the call runs eagerly.
//
// A call is run past the mode only where the mode would have run it eagerly with nothing
// else to do: the dispatch mode stack holds one mode, accel's; no argument carries the
// Python key (tensor subclasses, FakeTensor); and the op is a view or factory op (never a
// flush: accel/ops.py VIEW_OPS), or any other op the interceptor does not defer while the
// calling thread's region has no pending call. Ops the interceptor may defer, and
// CompositeImplicitAutograd ops (whose parts the interceptor must see, as it does below
// autograd), always take the usual path.
//
// Recording calls in C++. A call the interceptor would defer is, once the same call (op,
// argument wiring, dtypes, shapes, strides, which arguments are runtime scalars) has been
// recorded from the same trie node before, recorded here without crossing into Python.
// It has to happen where the mode sees the call, below autograd: the filter sends such a
// call on with the Python key taken out of its key set and the `Fake` key put in, so that
// after autograd (and ADInplaceOrView) it lands on this library's second fallback, just
// below the Python key. There the call's key is built from the stack
// (include/accel/region_view.h mirrors the region's inputs and outputs) and looked up among
// the trie edges the interceptor has taken (include/accel/call_keys.h: the keys, the
// edges); a hit calls the region core's _replay
// (accel/_core.pyx), which records the call as record() did, given the call's new inputs
// and runtime scalars. Every other call goes on to the Python key (put back), as it would
// have, and the edge it takes is learnt from the core's `last_call`. The key refines the
// interceptor's: equal keys here mean equal keys there, except for numbers, which are
// keyed by class (type, zero, NaN, sign, at the schema's default or not) and checked
// against the values the interceptor took as constants. While autograd's generated
// kernel handles such a call (around record()), the Python key is excluded: autograd
// saves outputs for backward as shallow copies, which with a dispatch mode on the stack
// are aten::detach calls into it, and without the key they stay in C++, as in eager. Not
// where anything else runs above record() and could make calls that must reach the mode
// (an op that decomposes above autograd, functorch, autocast, ...; with grad mode on,
// autograd's kernel of an op writing an argument, which clones `self` for the backward),
// nor where saved-tensor hooks are set (a pack hook may read the pending output) or an
// argument is a dual tensor (forward-mode AD computes the output's tangent from it there).
//
// A region's first call that its trie edge marks to run eagerly (a small or idle region's:
// TrieNode.eager_first) is recognized above autograd, by the same key from the same
// arguments while the thread's region is empty, and runs past the mode as a plain call
// does: not through autograd to the second fallback and boxed from there. (On the H100's
// GPT-2 step, where every region's calls run eagerly, 0.87-0.90x of eager's speed against
// 0.85-0.89x; the CPU proxy's with every region eager, 0.82x against 0.79-0.80x.)
//
// The fallback is boxed (each call's arguments packed into IValues and unpacked again by
// the next kernel); the views, factories, matmuls, composite and deferrable ops a model's
// step calls most have unboxed kernels on the same key that route() their calls as it does
// (include/accel/unboxed_kernels.h).
//
// torch has no dispatch key reserved for modes outside it; TESTING_ONLY_GenericMode is
// a mode key above autograd that no part of torch registers a kernel for (only the
// dispatcher's own C++ tests do; accel checks that no fallback is registered before it
// registers its own). `Fake`, torchdistx's out-of-tree key just below Python, is likewise
// unused by torch itself: accel checks it the same way.
//
// The library also exports the region core's C++ helpers (include/accel/core_helpers.h).
// Built at run time against the installed torch (accel/dispatch.py) and kept in the store.
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/Context.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/mm_ops.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/DynamicTypes.h>
#include <ATen/EmptyTensor.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/core/PythonFallbackKernel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "accel/call_keys.h"
#include "accel/core_helpers.h"
#include "accel/gemm.h"
#include "accel/region_view.h"
#include "accel/unboxed_kernels.h"

namespace {

using c10::DispatchKey;
using c10::DispatchKeySet;
using c10::OperatorHandle;

constexpr DispatchKey kFilterKey = DispatchKey::TESTING_ONLY_GenericMode;
constexpr DispatchKey kRecordKey = DispatchKey::Fake;  // below autograd, just below Python
const DispatchKeySet kBypass({DispatchKey::Python, DispatchKey::PythonTLSSnapshot, kFilterKey});
const DispatchKeySet kPython(DispatchKey::Python);
const DispatchKeySet kRecord(kRecordKey);
const DispatchKeySet kSnapshot(DispatchKey::PythonTLSSnapshot);
const DispatchKeySet kBelowSnapshot(DispatchKeySet::FULL_AFTER, DispatchKey::PythonTLSSnapshot);

// kMode: composite ops (the mode's path); kDefer: ops the interceptor may defer (the
// mode's path, or recorded here), kDeferComposite such an op that decomposes above
// autograd (CompositeImplicitAutograd: its parts are calls of their own), kDeferMutable
// such an op that writes an argument (in place, or out=), whose autograd kernel may make a
// call of its own (`mul_` and most in-place ops clone `self` for their backward); kView,
// kPlain: run past the mode where they can; kMatmul: mm and bmm, kAddmm: addmm, run past
// the mode as plain ops are, and through the matmul kernels below autograd (addmm always
// there: matmul_addmm() leaves a CPU bias to the thread's region)
enum Kind : uint8_t {
  kMode = 0, kView = 1, kPlain = 2, kDefer = 3, kDeferComposite = 4, kDeferMutable = 5, kMatmul = 6,
  kAddmm = 7
};

std::mutex g_mu;  // guards the tables below
std::unordered_set<std::string> g_deferrable, g_views;  // "aten::add.Tensor", "aten::view"
std::unordered_map<OperatorHandle, uint8_t> g_kinds;  // filled on each op's first call
PyTypeObject* g_mode_types[2] = {nullptr, nullptr};  // accel's dispatch mode classes
std::unique_ptr<torch::Library> g_library, g_record_library, g_unboxed_library, g_matmul_library;
int g_unboxed = 0;  // ops with unboxed kernels on the filter's key

// the calling thread's region (null: not bound yet); its first byte is nonzero while it
// has pending calls
thread_local accel_region_view* t_view = nullptr;
// calls run past the mode, calls passed on, calls recorded here, small or idle regions'
// first calls run eagerly here
thread_local uint64_t t_counts[4] = {0, 0, 0, 0};
std::atomic<uint64_t> g_recorded{0};  // calls recorded here, on every thread
std::atomic<uint64_t> g_small{0};  // small or idle regions' first calls run eagerly, every thread
std::atomic<bool> g_small_on{true};   // ACCEL_EAGER_SMALL_REGIONS (accel_filter_small_regions)
std::atomic<bool> g_matmul_on{false};  // ACCEL_CPU_MATMUL, on a CPU that runs the kernel
std::atomic<uint64_t> g_matmuls{0};     // matmuls run by accel's kernel, every thread
// accel.allocator.empty_strided while regions take their CPU outputs from accel's pool
// (ACCEL_CPU_POOL; accel_filter_pool), which the matmuls below then take theirs from too
PyObject* g_pool_alloc = nullptr;
std::atomic<bool> g_pool_on{false};
std::atomic<uint64_t> g_pooled{0};  // matmul outputs taken from the pool, every thread
PyObject* g_replay = nullptr;  // RegionCore._replay (unbound)
PyObject* g_flush = nullptr;   // accel.interceptor.flush

std::string full_name(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

uint8_t kind_locked(const OperatorHandle& op) {
  auto it = g_kinds.find(op);
  if (it != g_kinds.end()) return it->second;
  std::string name = full_name(op.operator_name());
  uint8_t k = kPlain;
  if (name == "aten::mm" || name == "aten::bmm") {
    k = kMatmul;
  } else if (name == "aten::addmm") {
    k = kAddmm;
  } else if (g_deferrable.count(name)) {
    k = op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd) ? kDeferComposite
        : op.schema().is_mutable()                                          ? kDeferMutable
                                                                             : kDefer;
  } else if (op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd)) {
    k = kMode;
  } else if (g_views.count(name)) {
    k = kView;
  }
  g_kinds.emplace(op, k);
  return k;
}

uint8_t kind_of(const OperatorHandle& op) {
  std::lock_guard<std::mutex> guard(g_mu);
  return kind_locked(op);
}

bool has_python_key(const c10::IValue& v) {
  return v.isTensor() &&
         v.toTensor().unsafeGetTensorImpl()->key_set().has(DispatchKey::Python);
}

// Whether `pred` holds for an argument of the call on `stack`, or an element of a list one.
template <typename Pred>
bool any_argument(const OperatorHandle& op, const torch::jit::Stack& stack, Pred pred) {
  size_t n = op.schema().arguments().size();
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (pred(v)) return true;
    if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (pred(e)) return true;
      }
    }
  }
  return false;
}

// The mode stack holds accel's mode alone.
bool accel_mode_alone() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() != 1) return false;
  const auto& mode = c10::impl::TorchDispatchModeTLS::get_stack_at(0);
  PyTypeObject* type = Py_TYPE(mode->ptr(&mode->pyinterpreter()));
  return type == g_mode_types[0] || type == g_mode_types[1];
}

// The mode stack holds accel's mode alone, and no argument is a Python-key tensor.
bool only_accel(const OperatorHandle& op, const torch::jit::Stack& stack) {
  return accel_mode_alone() && !any_argument(op, stack, has_python_key);
}

// The region may take a call recorded here: its owner thread, not busy, not at its size
// cap (a region's first call included: the core's _replay launches its kernel ahead where
// the interceptor would).
bool can_record(const accel_region_view* v) {
  return v != nullptr && v->replay && !v->busy && v->n_calls + 1 < v->cap &&
         v->n_ext < ACCEL_VIEW_MAX - 64 && v->n_out < ACCEL_VIEW_MAX - 64;
}

// Flush the calling thread's pending region, as the mode does before a call it does not
// defer (its calls run eagerly inside, past the mode). Returns whether nothing is pending
// now; an exception from the flush propagates as the Python exception it is.
bool flush_region() {
  pybind11::gil_scoped_acquire gil;
  PyObject* r;
  {
    c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
    r = PyObject_CallNoArgs(g_flush);
  }
  if (r == nullptr) {
    python_error err;
    err.persist();
    throw err;
  }
  Py_DECREF(r);
  return t_view->pending == 0;
}

// The keys a call sent to record() passes on its way (those above `Fake`) are autograd's
// and the Python keys alone: no functorch transform, autocast, functionalization,
// conjugate or negative view, whose kernels would make calls of their own there.
bool only_autograd_above_record(DispatchKeySet ks) {
  for (DispatchKey k : ks) {
    DispatchKey f = c10::toFunctionalityKey(k);
    if (static_cast<uint16_t>(f) <= static_cast<uint16_t>(kRecordKey)) continue;
    if (f != DispatchKey::Python && f != DispatchKey::PythonTLSSnapshot &&
        f != DispatchKey::ADInplaceOrView && f != DispatchKey::AutogradFunctionality &&
        f != DispatchKey::AutogradOther) {
      return false;
    }
  }
  return true;
}

// An argument carries a forward-mode gradient (a dual tensor, level 0: torch nests no
// more): autograd's kernel computes the output's tangent from the pending output there.
bool has_forward_grad(const OperatorHandle& op, const torch::jit::Stack& stack) {
  return any_argument(op, stack, [](const c10::IValue& v) {
    return v.isTensor() && v.toTensor().defined() && v.toTensor()._fw_grad(0).defined();
  });
}

// Whether the call on `stack`, made while the calling thread's region is empty, is a
// small or idle region's first call (TrieNode.eager_first), which runs eagerly: its key
// from the region's node names a trie edge marked so (include/accel/call_keys.h; the key
// record() below builds for the same call, after autograd, from the same arguments).
bool eager_edge(const OperatorHandle& op, const torch::jit::Stack& stack) {
  thread_local std::vector<int64_t> key;
  thread_local std::vector<const c10::TensorImpl*> fresh;
  if (!accel_keys::make_key(op, stack, t_view, &key, &fresh)) return false;
  const accel_keys::Edge* e = accel_keys::find_edge(key);
  return e != nullptr && e->eager.load(std::memory_order_relaxed);
}

// Sends a call on with key set `ks` (`redispatch`, as route() below). Where the next key it
// takes is PythonTLSSnapshot (a dispatch mode is on the stack), does here what that key's
// boxed fallback does (torch's pythonTLSSnapshotFallback: note the thread's key set for the
// Python key below, unless noted already, and go on below the key), so that an unboxed call
// is not boxed there.
template <class Redispatch>
decltype(auto) past_snapshot(DispatchKeySet ks, Redispatch redispatch) {
  DispatchKeySet below = ks & kBelowSnapshot;
  if ((below | kSnapshot) != ks) return redispatch(ks);
  at::impl::MaybeSetTLSOnEntryGuard guard;
  return redispatch(below);
}

// What the filter does with a call (see the top of the file): `kind()` is the op's Kind,
// `only_accel()` whether the mode stack holds accel's mode alone and no argument is a
// Python-key tensor, `forward_grad()` whether an argument is a dual tensor,
// `eager_first()` whether the call (made while the thread's region is empty) begins a
// small or idle region, which runs it eagerly (eager_edge()), and `redispatch(ks)` sends
// the call on with key set `ks` (boxed: filter() below; unboxed: the kernels of
// include/accel/unboxed_kernels.h).
template <class Kind, class OnlyAccel, class ForwardGrad, class EagerFirst, class Redispatch>
decltype(auto) route(DispatchKeySet ks, Kind kind_of_op, OnlyAccel only_accel,
                     ForwardGrad forward_grad, EagerFirst eager_first, Redispatch redispatch) {
  ks = ks.remove(kFilterKey);
  if (ks.has(DispatchKey::Python)) {
    uint8_t kind = kind_of_op();
    const accel_region_view* v = t_view;
    // a plain call with a region pending: flushed here first, as the mode would have
    bool plain = (kind == kPlain || kind == kMatmul || kind == kAddmm) && v != nullptr &&
                 (!v->pending || (v->replay && !v->busy));
    if ((kind == kView || plain) && only_accel() &&
        (kind == kView || !v->pending || flush_region())) {
      ++t_counts[0];
      bool to_matmul = kind == kAddmm || (kind == kMatmul && (g_matmul_on.load(std::memory_order_relaxed) ||
                                                              g_pool_on.load(std::memory_order_relaxed)));
      // addmm's deferred bias reaches record(), which may take the mode's path: the Python
      // key's fallback needs the thread's key set as the call found it, which the
      // PythonTLSSnapshot key notes and this path skips (torch 2.11 asserts: "tls_on_entry.
      // has_value()"), so it is noted here, before the bypass keys are excluded
      std::optional<at::impl::MaybeSetTLSOnEntryGuard> snapshot;
      if (to_matmul) snapshot.emplace();
      c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
      if (to_matmul) return redispatch((ks - kBypass) | kRecord);  // to matmul(), after autograd
      return redispatch(ks - kBypass);
    }
    bool whole = kind == kDefer || kind == kDeferMutable;  // reaches record() as itself
    if ((whole || kind == kDeferComposite) && can_record(v) && only_accel()) {
      if (whole && !v->pending && g_small_on.load(std::memory_order_relaxed) && eager_first()) {
        // decided here, above autograd, the op is run as a plain call is: the mode would
        // run it eagerly (record() below does the same for a call that reaches it). A call
        // not decided so has its key built again there: one look-up more for a region's
        // first call, about 0.5 µs on the dev VM
        ++t_counts[0];
        ++t_counts[3];
        g_small.fetch_add(1, std::memory_order_relaxed);
        c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
        return redispatch(ks - kBypass);
      }
      ++t_counts[1];
      // to record(), after autograd; the Python key excluded meanwhile where autograd's
      // generated kernel is all that runs before record() (see the top of the file;
      // record() puts it back while it runs), and it calls no op: for an op writing an
      // argument, only with grad mode off (with it on, `self.clone()` for the backward
      // would read a pending `self` unfilled, past the mode)
      std::optional<c10::impl::ExcludeDispatchKeyGuard> no_python;
      if ((kind == kDefer || (kind == kDeferMutable && !c10::GradMode::is_enabled())) &&
          only_autograd_above_record(ks) &&
          at::SavedTensorDefaultHooks::get_tls_state().stack.empty() && !forward_grad()) {
        no_python.emplace(kPython);
      }
      return past_snapshot((ks - kPython) | kRecord, redispatch);
    }
  }
  ++t_counts[1];
  return past_snapshot(ks, redispatch);
}

void filter(const OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  route(
      ks, [&] { return kind_of(op); }, [&] { return only_accel(op, *stack); },
      [&] { return has_forward_grad(op, *stack); }, [&] { return eager_edge(op, *stack); },
      [&](DispatchKeySet to) { op.redispatchBoxed(to, stack); });
}

// -- unboxed kernels ------------------------------------------------------------------
// What the unboxed kernels of include/accel/unboxed_kernels.h call: route(), with the
// filter's key and mode check.
struct FilterRoute {
  static constexpr DispatchKey kKey = kFilterKey;
  static bool mode_alone() { return accel_mode_alone(); }
  static bool eager_first(const OperatorHandle& op, const torch::jit::Stack& stack) {
    return eager_edge(op, stack);
  }
  template <class... A>
  static decltype(auto) send(A&&... a) { return route(std::forward<A>(a)...); }
};

// Registers the unboxed kernels in a library of their own (caller holds g_mu).
void register_unboxed() {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kFilterKey,
                                              __FILE__, __LINE__);
  g_unboxed = accel_unboxed::add_all<FilterRoute>(
      *lib, [](const OperatorHandle& op) { return kind_locked(op); });
  g_unboxed_library = std::move(lib);
}

// -- recording ------------------------------------------------------------------------
// (the calls' keys and the trie edges: include/accel/call_keys.h)
using namespace accel_keys;

// Torch function modes and subclasses off while it lives (torch._C.DisableTorchFunction).
struct NoTorchFunction {
  at::impl::TorchFunctionDisabledState was = at::impl::PythonTorchFunctionTLS::get_disabled_state();
  NoTorchFunction() {
    at::impl::PythonTorchFunctionTLS::set_disabled_state(at::impl::TorchFunctionDisabledState::ALL_DISABLED);
  }
  ~NoTorchFunction() { at::impl::PythonTorchFunctionTLS::set_disabled_state(was); }
};

// Record the call through `e` (the GIL held): its arguments are the last `n` entries of
// `args` (the stack itself, or accel.cat's arguments built from a cat or stack call:
// cat_arguments()); on success they are replaced by the call's results on `stack`, which
// holds `n_stack` arguments. False: the region did not take it (nothing changed; the
// mode's path decides).
bool record_edge(const Edge& e, accel_region_view* v, torch::jit::Stack* stack, size_t n_stack,
                 const torch::jit::Stack& args, size_t n) {
  size_t base = args.size() - n;
  for (const Check& c : e.constants) {
    const c10::IValue& x = args[base + c.pos];
    if (x.isDouble() && x.toDouble() != x.toDouble()) continue;  // NaN: keyed by class
    if (!same_number(x, c)) return false;
  }
  PyObject* exts = PyTuple_New(static_cast<Py_ssize_t>(e.new_ext.size()));
  PyObject* scalars = exts ? PyTuple_New(static_cast<Py_ssize_t>(e.runtime.size())) : nullptr;
  bool ok = scalars != nullptr;
  for (size_t k = 0; ok && k < e.new_ext.size(); ++k) {
    PyObject* t = THPVariable_Wrap(args[base + e.new_ext[k]].toTensor());
    ok = t != nullptr;
    if (ok) PyTuple_SET_ITEM(exts, k, t);
  }
  for (size_t k = 0; ok && k < e.runtime.size(); ++k) {
    PyObject* s = number_object(args[base + e.runtime[k]]);
    ok = s != nullptr;
    if (ok) PyTuple_SET_ITEM(scalars, k, s);
  }
  PyObject* res = nullptr;
  if (ok) {
    // as inside the mode's __torch_dispatch__: the calls it makes (allocating outputs) run
    // eagerly, past the mode and the filter, and with torch function handling off (a torch
    // function mode would see the region core's tensor methods as accel's flushing hooks:
    // accel/interceptor.py, _without_torch_function)
    c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
    NoTorchFunction no_torch_function;
    PyObject* argv[] = {static_cast<PyObject*>(v->region), e.child, e.call, exts, scalars, e.device};
    if (v->replay == 2) {  // the region's stand-in for _replay (argv[0] left out)
      res = PyObject_Vectorcall(static_cast<PyObject*>(v->replay_fn), argv + 1, 5, nullptr);
    } else {
      res = PyObject_Vectorcall(g_replay, argv, 6, nullptr);
    }
  }
  Py_XDECREF(exts);
  Py_XDECREF(scalars);
  if (res == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {  // KeyboardInterrupt, say: raised here
      python_error err;
      err.persist();
      throw err;
    }
    PyErr_Clear();  // the mode's path raises what there is to raise
    return false;
  }
  torch::jit::drop(*stack, n_stack);
  if (PyTuple_Check(res)) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(res); ++k) {
      PyObject* r = PyTuple_GET_ITEM(res, k);
      stack->emplace_back(r == Py_None ? at::Tensor() : THPVariable_Unpack(r));
    }
  } else {
    stack->emplace_back(THPVariable_Unpack(res));
  }
  Py_DECREF(res);
  return true;
}

// aten::cat, aten::stack and accel::cat (accel/library.py), found once.
struct CatOps {
  std::optional<OperatorHandle> cat, stack, accel_cat;
};

const CatOps& cat_ops() {
  static const CatOps ops = [] {
    auto& d = c10::Dispatcher::singleton();
    return CatOps{d.findSchema({"aten::cat", ""}), d.findSchema({"aten::stack", ""}),
                  d.findSchema({"accel::cat", ""})};
  }();
  return ops;
}

constexpr size_t kCatMax = 8;  // accel.library.CAT_MAX

// accel.cat's arguments for a call of aten::cat or aten::stack (`is_stack`) on `stack`, as
// the mode records it (accel/library.py: cat_call, cat_args): 2 to kCatMax tensors of one
// rank (stack's unsqueezed at `dim`: views made as the mode makes them, below autograd and
// past the mode), None for the slots left, `dim` in [0, rank). False where the mode would
// not take the call for a reason its key does not show; the rest (sizes, empty tensors)
// the key decides, as accel.cat's call was recorded from the same key before or not.
bool cat_arguments(bool is_stack, const torch::jit::Stack& stack, torch::jit::Stack* out) {
  const c10::IValue& list = stack[stack.size() - 2];
  const c10::IValue& d = stack[stack.size() - 1];
  if (!list.isTensorList() || !d.isInt()) return false;
  c10::List<at::Tensor> tensors = list.toTensorList();
  size_t k = tensors.size();
  if (k < 2 || k > kCatMax) return false;
  int64_t nd = -1;
  for (size_t i = 0; i < k; ++i) {
    const at::Tensor& t = tensors.get(i);
    if (!t.defined() || (nd >= 0 && t.dim() != nd)) return false;
    nd = t.dim();
  }
  int64_t rank = is_stack ? nd + 1 : nd, dim = d.toInt();
  if (rank == 0 || dim < -rank || dim >= rank) return false;
  if (dim < 0) dim += rank;
  out->clear();
  {
    c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
    for (size_t i = 0; i < k; ++i) out->emplace_back(is_stack ? at::unsqueeze(tensors.get(i), dim) : tensors.get(i));
  }
  out->resize(kCatMax);  // None
  out->emplace_back(dim);
  return true;
}

// The fallback below autograd for the calls the filter sends here (see the top of the
// file); `ks`, with the Python key put back, is the mode's path.
// The Python key as the filter found it (not excluded), while record() runs.
struct PythonKeyBack {
  bool was = c10::impl::tls_is_dispatch_key_excluded(DispatchKey::Python);
  PythonKeyBack() { c10::impl::tls_set_dispatch_key_excluded(DispatchKey::Python, false); }
  ~PythonKeyBack() { c10::impl::tls_set_dispatch_key_excluded(DispatchKey::Python, was); }
};

void record(const OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  PythonKeyBack python_back;  // see filter()
  ks = ks.remove(kRecordKey) | kPython;
  accel_region_view* v = t_view;
  thread_local std::vector<int64_t> key;
  thread_local std::vector<const c10::TensorImpl*> fresh;
  size_t n = op.schema().arguments().size();
  // a cat or stack call is keyed and recorded as the accel.cat call the mode records for it
  const OperatorHandle* as = &op;
  torch::jit::Stack cat_args;
  bool ok = can_record(v);
  if (ok) {
    const CatOps& c = cat_ops();
    bool is_cat = c.cat && op == *c.cat, is_stack = c.stack && op == *c.stack;
    if ((is_cat || is_stack) && c.accel_cat) {
      ok = cat_arguments(is_stack, *stack, &cat_args);
      as = &*c.accel_cat;
    }
  }
  const torch::jit::Stack& args = as == &op ? *stack : cat_args;
  size_t n_args = as->schema().arguments().size();
  if (!ok || !make_key(*as, args, v, &key, &fresh)) {
    cat_args.clear();
    op.redispatchBoxed(ks, stack);
    return;
  }
  const Edge* e = find_edge(key);
  if (e != nullptr && e->eager.load(std::memory_order_relaxed) &&
      g_small_on.load(std::memory_order_relaxed)) {
    // a small or idle region's first call (its region is empty) that route() did not
    // catch: eagerly, as the mode would
    ++t_counts[3];
    g_small.fetch_add(1, std::memory_order_relaxed);
    cat_args.clear();
    c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
    op.redispatchBoxed(ks - kPython, stack);
    return;
  }
  if (e != nullptr && e->call != Py_None) {  // (None: an edge learnt only to run eagerly)
    bool done;
    {
      pybind11::gil_scoped_acquire gil;
      done = record_edge(*e, v, stack, n, args, n_args);
    }
    if (done) {
      ++t_counts[2];
      g_recorded.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    cat_args.clear();
    op.redispatchBoxed(ks, stack);
    return;
  }
  cat_args.clear();  // (its views would keep pending outputs alive through a flush)
  std::vector<int64_t> mine(key);
  const void* parent = v->node;
  int32_t before = v->n_calls;
  op.redispatchBoxed(ks, stack);
  if (v->n_calls == before + 1 && v->node != parent) {
    pybind11::gil_scoped_acquire gil;
    learn(*as, std::move(mine), parent, v);
  } else if (e == nullptr && v->n_calls == before && v->node == parent) {
    // not recorded: where the mode ran it as a small or idle region's first call, the
    // edge is learnt to run it eagerly here, above autograd, from then on (a region whose
    // first call was marked before the filter was loaded is otherwise never learnt, and
    // its first call takes the mode's path at every step)
    pybind11::gil_scoped_acquire gil;
    learn(*as, std::move(mine), parent, v, /*eager=*/true);
  }
}

#include "accel/matmul_kernels.inc"  // mm, bmm and addmm on the record key

void split_lines(const char* text, std::unordered_set<std::string>* out) {
  std::istringstream in(text ? text : "");
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out->insert(line);
  }
}

// (g_mu held) The two boxed fallbacks, once per process: "" or the reason they cannot be
// registered.
const char* fallbacks_locked() {
  static std::string error;
  if (g_library) return "";
  auto& dispatcher = c10::Dispatcher::singleton();
  if (dispatcher.hasBackendFallbackForDispatchKey(kFilterKey)) {
    return "another library registered a fallback for TESTING_ONLY_GenericMode";
  }
  if (dispatcher.hasBackendFallbackForDispatchKey(kRecordKey)) {
    return "another library registered a fallback for Fake";
  }
  try {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kFilterKey,
                                                __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&filter>());
    auto rec = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kRecordKey,
                                                __FILE__, __LINE__);
    rec->fallback(torch::CppFunction::makeFromBoxedFunction<&record>());
    g_library = std::move(lib);
    g_record_library = std::move(rec);
  } catch (const std::exception& e) {
    error = e.what();
    return error.c_str();
  }
  return "";
}

}  // namespace

extern "C" {

// Register the two boxed fallbacks (once per process): most of the registration's time
// (every operator's dispatch table gets an entry for each key: about 20 ms on the dev
// VM), which accel.dispatch.prefetch does on its thread while the program builds its
// model. Safe while other threads make calls: a fallback's registration writes only its
// own key's entry of each operator's table (and sets the key's bit of the operator's
// non-fallthrough keys, already set), keys no call carries before accel_filter_include,
// under the dispatcher's lock against other registrations. Returns "" or the reason.
const char* accel_filter_fallbacks() {
  std::lock_guard<std::mutex> guard(g_mu);
  return fallbacks_locked();
}

// Register the filter (once per process; again: the op names only). Returns an empty
// string, or the reason it cannot be registered (the interceptor then keeps every call on
// the mode's path). The fallbacks where accel_filter_fallbacks has not, then the unboxed
// kernels and the matmuls' kernels, which add to operators' kernel maps: on a thread that
// makes no call meanwhile.
// deferrable / views: op names ("aten::add.Tensor"), one per line; mode_type_a/b: the
// interceptor's mode classes (type objects).
const char* accel_filter_register(const char* deferrable, const char* views,
                                  void* mode_type_a, void* mode_type_b, void* replay,
                                  void* flush) {
  static std::string error;
  std::lock_guard<std::mutex> guard(g_mu);
  g_deferrable.clear();
  g_views.clear();
  g_kinds.clear();
  split_lines(deferrable, &g_deferrable);
  split_lines(views, &g_views);
  g_mode_types[0] = static_cast<PyTypeObject*>(mode_type_a);
  g_mode_types[1] = static_cast<PyTypeObject*>(mode_type_b);
  if (g_replay == nullptr) {
    g_replay = static_cast<PyObject*>(replay);
    g_flush = static_cast<PyObject*>(flush);
    Py_INCREF(g_replay);
    Py_INCREF(g_flush);
  }
  if (g_matmul_library) return "";
  const char* err = fallbacks_locked();
  if (*err) return err;
  try {
    g_matmul_library = matmul_library();
    register_unboxed();
  } catch (const std::exception& e) {
    error = e.what();
    return error.c_str();
  }
  return "";
}

// Include the filter's key in the calling thread's dispatch key set (on != 0) or not;
// returns whether it was included.
int accel_filter_include(int on) {
  bool was = c10::impl::tls_is_dispatch_key_included(kFilterKey);
  c10::impl::tls_set_dispatch_key_included(kFilterKey, on != 0);
  return was;
}

// The calling thread's region (include/accel/region_view.h).
void accel_filter_bind(accel_region_view* view) { t_view = view; }

// The region core's set of storages shared outside the dispatcher (region_view.h), whose
// calls the filter leaves to the interceptor.
void accel_filter_shared(const accel_shared_set* shared) { accel_keys::g_shared.store(shared); }

// The calling thread's counts: [0] calls run past the mode, [1] calls passed on, [2] calls
// recorded by the filter, [3] small or idle regions' first calls it ran eagerly (also in [0]
// where route() ran them past the mode, in [1] where record() did).
void accel_filter_counts(uint64_t* out) {
  for (int k = 0; k < 4; ++k) out[k] = t_counts[k];
}

// The number of ops with unboxed kernels on the filter's key.
int accel_filter_unboxed() { return g_unboxed; }

// Register the unboxed kernels (on != 0) or remove them (every call then takes the boxed
// fallback); returns how many are registered. For measuring them side by side in one
// process: only while no other thread makes calls (the dispatcher's tables change).
int accel_filter_set_unboxed(int on) {
  std::lock_guard<std::mutex> guard(g_mu);
  if (!g_matmul_library) return 0;
  if (on == 0) {
    g_unboxed_library.reset();
    g_unboxed = 0;
  } else if (!g_unboxed_library) {
    register_unboxed();
  }
  return g_unboxed;
}

// Calls recorded by the filter on every thread.
uint64_t accel_filter_recorded() { return g_recorded.load(std::memory_order_relaxed); }

// Small regions' first calls the filter ran eagerly, on every thread.
uint64_t accel_filter_small() { return g_small.load(std::memory_order_relaxed); }

// Whether marked small regions' first calls run eagerly (on != 0: ACCEL_EAGER_SMALL_REGIONS).
void accel_filter_small_regions(int on) { g_small_on.store(on != 0, std::memory_order_relaxed); }

// Run eagerly from now on the calls whose edges lead to trie node `node` (a small region's
// first call: TrieNode.eager_first); an edge not learnt yet is learnt so marked where the
// mode runs such a call eagerly (record()).
void accel_filter_eager_first(void* node) {
  std::lock_guard<std::mutex> guard(g_edges_mu);
  for (auto& kv : g_edges) {
    if (kv.second->child == node) kv.second->eager.store(true, std::memory_order_relaxed);
  }
}

// Where float32 CPU matmuls run accel's kernel (ACCEL_CPU_MATMUL): mode 0 nowhere, 1 on AMD
// CPUs from Zen 5 on (accel_gemm::faster_than_eagers: MKL's generic path there; its own
// AVX-512 kernels on Intel CPUs are faster: on an H200 host's Xeon, 1.4-2.5x accel's), 2 on
// any CPU; never without AVX-512F. Returns whether they now do.
int accel_filter_matmul(int mode) {
  bool on = accel_gemm::supported() && (mode == 2 || (mode == 1 && accel_gemm::faster_than_eagers()));
  g_matmul_on.store(on, std::memory_order_relaxed);
  return on;
}

// Matmuls run by accel's kernel, on every thread.
uint64_t accel_filter_matmuls() { return g_matmuls.load(std::memory_order_relaxed); }

// Whether CPU mm, bmm and addmm calls the filter runs past the mode write their outputs of
// at least kPoolMinBytes into blocks of accel's output pool: `alloc` (a new reference is taken;
// the GIL taken) is accel.allocator.empty_strided while regions take their outputs from the
// pool, None where they do not (the matmuls then allocate theirs as eager does). Takes the
// GIL (ctypes releases it).
void accel_filter_pool(PyObject* alloc) {
  pybind11::gil_scoped_acquire gil;  // pooled() reads g_pool_alloc under it
  bool on = alloc != nullptr && alloc != Py_None;
  if (on) Py_INCREF(alloc);
  g_pool_on.store(false, std::memory_order_relaxed);
  PyObject* old = g_pool_alloc;
  g_pool_alloc = on ? alloc : nullptr;
  Py_XDECREF(old);
  g_pool_on.store(on, std::memory_order_relaxed);
}

// Matmul outputs taken from the pool, on every thread.
uint64_t accel_filter_pooled() { return g_pooled.load(std::memory_order_relaxed); }

}  // extern "C"
