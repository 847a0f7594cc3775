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
// torch has no dispatch key reserved for modes outside it; TESTING_ONLY_GenericMode is
// a mode key above autograd that no part of torch registers a kernel for (only the
// dispatcher's own C++ tests do; accel checks that no fallback is registered before it
// registers its own).
//
// Built at run time against the installed torch (accel/dispatch.py) and kept in the store.
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace {

using c10::DispatchKey;
using c10::DispatchKeySet;
using c10::OperatorHandle;

constexpr DispatchKey kFilterKey = DispatchKey::TESTING_ONLY_GenericMode;
const DispatchKeySet kBypass({DispatchKey::Python, DispatchKey::PythonTLSSnapshot, kFilterKey});

enum Kind : uint8_t { kMode = 0, kView = 1, kPlain = 2 };

std::mutex g_mu;  // guards the tables below
std::unordered_set<std::string> g_deferrable, g_views;  // "aten::add.Tensor", "aten::view"
std::unordered_map<OperatorHandle, uint8_t> g_kinds;  // filled on each op's first call
PyTypeObject* g_mode_types[2] = {nullptr, nullptr};  // accel's dispatch mode classes
std::unique_ptr<torch::Library> g_library;

// the calling thread's region: nonzero while it has pending calls (null: not bound yet)
thread_local const volatile uint8_t* t_pending = nullptr;
thread_local uint64_t t_counts[2] = {0, 0};  // calls run past the mode, calls passed on

std::string full_name(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

uint8_t kind_of(const OperatorHandle& op) {
  std::lock_guard<std::mutex> guard(g_mu);
  auto it = g_kinds.find(op);
  if (it != g_kinds.end()) return it->second;
  std::string name = full_name(op.operator_name());
  uint8_t k = kPlain;
  if (g_deferrable.count(name) ||
      op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd)) {
    k = kMode;
  } else if (g_views.count(name)) {
    k = kView;
  }
  g_kinds.emplace(op, k);
  return k;
}

bool has_python_key(const c10::IValue& v) {
  return v.isTensor() &&
         v.toTensor().unsafeGetTensorImpl()->key_set().has(DispatchKey::Python);
}

// The mode stack holds accel's mode alone, and no argument is a Python-key tensor.
bool only_accel(const OperatorHandle& op, const torch::jit::Stack& stack) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() != 1) return false;
  const auto& mode = c10::impl::TorchDispatchModeTLS::get_stack_at(0);
  PyTypeObject* type = Py_TYPE(mode->ptr(&mode->pyinterpreter()));
  if (type != g_mode_types[0] && type != g_mode_types[1]) return false;
  size_t n = op.schema().arguments().size();
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (has_python_key(v)) return false;
    if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (has_python_key(e)) return false;
      }
    }
  }
  return true;
}

void filter(const OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  ks = ks.remove(kFilterKey);
  if (ks.has(DispatchKey::Python)) {
    uint8_t kind = kind_of(op);
    if ((kind == kView || (kind == kPlain && t_pending != nullptr && *t_pending == 0)) &&
        only_accel(op, *stack)) {
      ++t_counts[0];
      c10::impl::ExcludeDispatchKeyGuard guard(kBypass);
      op.redispatchBoxed(ks - kBypass, stack);
      return;
    }
  }
  ++t_counts[1];
  op.redispatchBoxed(ks, stack);
}

void split_lines(const char* text, std::unordered_set<std::string>* out) {
  std::istringstream in(text ? text : "");
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out->insert(line);
  }
}

}  // namespace

extern "C" {

// Register the fallback (once per process). Returns an empty string, or the reason it
// cannot be registered (the interceptor then keeps every call on the mode's path).
// deferrable / views: op names ("aten::add.Tensor"), one per line; mode_type_a/b: the
// interceptor's mode classes (type objects).
const char* accel_filter_register(const char* deferrable, const char* views,
                                  void* mode_type_a, void* mode_type_b) {
  static std::string error;
  std::lock_guard<std::mutex> guard(g_mu);
  g_deferrable.clear();
  g_views.clear();
  g_kinds.clear();
  split_lines(deferrable, &g_deferrable);
  split_lines(views, &g_views);
  g_mode_types[0] = static_cast<PyTypeObject*>(mode_type_a);
  g_mode_types[1] = static_cast<PyTypeObject*>(mode_type_b);
  if (g_library) return "";
  if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kFilterKey)) {
    return "another library registered a fallback for TESTING_ONLY_GenericMode";
  }
  try {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kFilterKey,
                                                __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&filter>());
    g_library = std::move(lib);
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

// The calling thread's pending flag (a byte its region sets while it has calls).
void accel_filter_bind(const volatile uint8_t* pending) { t_pending = pending; }

// The calling thread's counts: [0] calls run past the mode, [1] calls passed on.
void accel_filter_counts(uint64_t* out) {
  out[0] = t_counts[0];
  out[1] = t_counts[1];
}

}  // extern "C"
