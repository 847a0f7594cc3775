// Unboxed kernels for the ops a model's step calls most, on the dispatch filter's key
// (include/accel/dispatch_filter.cpp). The filter's fallback is boxed: each call's arguments
// are packed into IValues (a heap vector, a list for each int list) and unpacked again by
// the next kernel; in a model's step, with caches cold, that costs about 0.7 µs a call on
// the dev VM (a sixth of a host-bound CPU step's time with nothing deferred). These kernels
// hand each call, its arguments as they are, to the filter's route() (what the fallback
// does with a stack) and send it on with at::_ops::<op>::redispatch; a deferred call is
// boxed once, by the filter's recording.
#pragma once

#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/ops/_local_scalar_dense_ops.h>
#include <ATen/ops/_log_softmax_ops.h>
#include <ATen/ops/_log_softmax_backward_data_ops.h>
#include <ATen/ops/_reshape_alias_ops.h>
#include <ATen/ops/_softmax_ops.h>
#include <ATen/ops/_softmax_backward_data_ops.h>
#include <ATen/ops/_to_copy_ops.h>
#include <ATen/ops/_unsafe_view_ops.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/alias_ops.h>
#include <ATen/ops/arange_ops.h>
#include <ATen/ops/as_strided_ops.h>
#include <ATen/ops/baddbmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/cat_ops.h>
#include <ATen/ops/chunk_ops.h>
#include <ATen/ops/clone_ops.h>
#include <ATen/ops/constant_pad_nd_ops.h>
#include <ATen/ops/contiguous_ops.h>
#include <ATen/ops/copy_ops.h>
#include <ATen/ops/cross_entropy_loss_ops.h>
#include <ATen/ops/detach_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/dropout_ops.h>
#include <ATen/ops/embedding_ops.h>
#include <ATen/ops/embedding_backward_ops.h>
#include <ATen/ops/embedding_dense_backward_ops.h>
#include <ATen/ops/empty_ops.h>
#include <ATen/ops/empty_like_ops.h>
#include <ATen/ops/empty_strided_ops.h>
#include <ATen/ops/exp_ops.h>
#include <ATen/ops/expand_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/flatten_ops.h>
#include <ATen/ops/full_ops.h>
#include <ATen/ops/full_like_ops.h>
#include <ATen/ops/gelu_ops.h>
#include <ATen/ops/gelu_backward_ops.h>
#include <ATen/ops/index_ops.h>
#include <ATen/ops/index_select_ops.h>
#include <ATen/ops/layer_norm_ops.h>
#include <ATen/ops/le_ops.h>
#include <ATen/ops/lift_fresh_ops.h>
#include <ATen/ops/linear_ops.h>
#include <ATen/ops/log_softmax_ops.h>
#include <ATen/ops/masked_fill_ops.h>
#include <ATen/ops/matmul_ops.h>
#include <ATen/ops/mean_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/narrow_ops.h>
#include <ATen/ops/native_layer_norm_ops.h>
#include <ATen/ops/native_layer_norm_backward_ops.h>
#include <ATen/ops/neg_ops.h>
#include <ATen/ops/new_empty_ops.h>
#include <ATen/ops/new_full_ops.h>
#include <ATen/ops/new_ones_ops.h>
#include <ATen/ops/new_zeros_ops.h>
#include <ATen/ops/nll_loss_ops.h>
#include <ATen/ops/nll_loss_backward_ops.h>
#include <ATen/ops/nll_loss_forward_ops.h>
#include <ATen/ops/nll_loss_nd_ops.h>
#include <ATen/ops/ones_ops.h>
#include <ATen/ops/ones_like_ops.h>
#include <ATen/ops/pad_ops.h>
#include <ATen/ops/permute_ops.h>
#include <ATen/ops/pow_ops.h>
#include <ATen/ops/reshape_ops.h>
#include <ATen/ops/resize_ops.h>
#include <ATen/ops/resolve_conj_ops.h>
#include <ATen/ops/resolve_neg_ops.h>
#include <ATen/ops/result_type_ops.h>
#include <ATen/ops/rsqrt_ops.h>
#include <ATen/ops/scalar_tensor_ops.h>
#include <ATen/ops/select_ops.h>
#include <ATen/ops/sigmoid_ops.h>
#include <ATen/ops/silu_ops.h>
#include <ATen/ops/slice_ops.h>
#include <ATen/ops/softmax_ops.h>
#include <ATen/ops/split_ops.h>
#include <ATen/ops/split_with_sizes_ops.h>
#include <ATen/ops/squeeze_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/sum_ops.h>
#include <ATen/ops/t_ops.h>
#include <ATen/ops/tanh_ops.h>
#include <ATen/ops/tanh_backward_ops.h>
#include <ATen/ops/threshold_backward_ops.h>
#include <ATen/ops/to_ops.h>
#include <ATen/ops/transpose_ops.h>
#include <ATen/ops/unbind_ops.h>
#include <ATen/ops/unsqueeze_ops.h>
#include <ATen/ops/view_ops.h>
#include <ATen/ops/where_ops.h>
#include <ATen/ops/zero_ops.h>
#include <ATen/ops/zeros_ops.h>
#include <ATen/ops/zeros_like_ops.h>

namespace accel_unboxed {

// Whether `pred` holds for a tensor argument, or a tensor in a list argument.
template <class Pred>
bool any_tensor(const Pred& pred, const at::Tensor& t) { return pred(t); }
template <class Pred>
bool any_tensor(const Pred& pred, const std::optional<at::Tensor>& t) {
  return t.has_value() && pred(*t);
}
template <class Pred>
bool any_tensor(const Pred& pred, const c10::ArrayRef<at::Tensor>& ts) {
  for (const at::Tensor& t : ts) {
    if (pred(t)) return true;
  }
  return false;
}
template <class Pred>
bool any_tensor(const Pred& pred, const at::ITensorListRef& ts) {
  for (const at::Tensor& t : ts) {
    if (pred(t)) return true;
  }
  return false;
}
template <class Pred>
bool any_tensor(const Pred& pred, const c10::List<std::optional<at::Tensor>>& ts) {
  for (const std::optional<at::Tensor>& t : ts) {
    if (t.has_value() && pred(*t)) return true;
  }
  return false;
}
template <class Pred, class T>
bool any_tensor(const Pred&, const T&) { return false; }  // not a tensor

// The kernel of at::_ops::Op on Filter::kKey. Filter::send(ks, kind, only_accel,
// forward_grad, eager_first, redispatch) routes the call (kind(): the op's kind, noted at
// registration; only_accel(): Filter::mode_alone() and no argument a Python-key tensor;
// forward_grad(): an argument carries a forward-mode tangent; eager_first():
// Filter::eager_first(op, stack) on the arguments boxed, whether the call begins a region
// it runs eagerly instead; redispatch(ks): the call sent on).
template <class Filter, class Op, class Schema = typename Op::schema>
struct Unboxed;

template <class Filter, class Op, class R, class... Args>
struct Unboxed<Filter, Op, R(Args...)> {
  static inline uint8_t kind = 0;  // set at registration
  static inline std::optional<c10::OperatorHandle> handle;  // likewise

  static R call(c10::DispatchKeySet ks, Args... args) {
    auto python_key = [](const at::Tensor& t) {
      return t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python);
    };
    auto dual = [](const at::Tensor& t) { return t.defined() && t._fw_grad(0).defined(); };
    return Filter::send(
        ks, [] { return kind; },
        [&] { return Filter::mode_alone() && !(any_tensor(python_key, args) || ...); },
        [&] { return (any_tensor(dual, args) || ...); },
        [&] { return Filter::eager_first(*handle, c10::impl::boxArgs<Args...>(args...)); },
        [&](c10::DispatchKeySet to) -> R { return Op::redispatch(to, args...); });
  }

  // Registers the kernel unless the op is not in this torch or already has a kernel on the
  // key; `kind_of(op)` gives its kind. Returns whether it did.
  template <class KindOf>
  static bool add(torch::Library& lib, const KindOf& kind_of) {
    auto op = c10::Dispatcher::singleton().findSchema({Op::name, Op::overload_name});
    if (!op || op->hasKernelForDispatchKey(Filter::kKey)) return false;
    kind = kind_of(*op);
    handle = *op;
    std::string name = Op::overload_name[0] ? std::string(Op::name) + "." + Op::overload_name
                                             : std::string(Op::name);
    lib.impl(name.c_str(), torch::dispatch(Filter::kKey, TORCH_FN(call)));
    return true;
  }
};

// The ops with unboxed kernels: the views, factories, matmuls, composite ops and deferrable
// ops a GPT-2 training step calls most, forward and backward (a deferred call is boxed
// once, by record()); the rest keep the boxed fallback.
#define ACCEL_UNBOXED_OPS(X)                                                                    \
  X(view) X(_unsafe_view) X(_reshape_alias) X(alias) X(detach) X(detach_) X(expand)           \
  X(permute) X(transpose_int) X(t) X(unsqueeze) X(squeeze_dim) X(squeeze_dims)                \
  X(slice_Tensor) X(select_int) X(as_strided) X(split_Tensor) X(split_with_sizes)             \
  X(unbind_int) X(narrow) X(chunk) X(reshape) X(contiguous) X(flatten_using_ints)             \
  X(empty_memory_format) X(empty_strided) X(empty_like) X(zeros) X(ones) X(full)              \
  X(zeros_like) X(ones_like) X(full_like) X(arange) X(arange_start) X(arange_start_step)      \
  X(lift_fresh) X(new_empty) X(new_zeros) X(new_ones) X(new_full) X(resolve_conj)             \
  X(resolve_neg) X(mm) X(bmm) X(addmm) X(baddbmm) X(matmul) X(linear) X(to_dtype)            \
  X(to_dtype_layout) X(to_device) X(to_other) X(cat) X(embedding) X(embedding_backward)       \
  X(embedding_dense_backward) X(index_select) X(index_Tensor) X(resize_)                      \
  X(result_type_Tensor) X(result_type_Scalar) X(dropout) X(layer_norm) X(softmax_int)         \
  X(log_softmax_int) X(cross_entropy_loss) X(nll_loss) X(nll_loss_nd) X(nll_loss_forward)     \
  X(nll_loss_backward) X(pad) X(constant_pad_nd) X(_local_scalar_dense) X(mul_Tensor)         \
  X(mul_Scalar) X(mul__Tensor) X(add_Tensor) X(add_Scalar) X(add__Tensor) X(sub_Tensor)       \
  X(div_Tensor) X(div_Scalar) X(neg) X(copy_) X(_to_copy) X(fill__Scalar) X(zero_) X(clone)   \
  X(sum) X(sum_dim_IntList) X(mean_dim) X(pow_Tensor_Scalar) X(where_self) X(le_Scalar)        \
  X(masked_fill_Scalar) X(scalar_tensor) X(tanh) X(tanh_backward) X(exp) X(rsqrt) X(sigmoid)   \
  X(silu) X(gelu) X(gelu_backward) X(threshold_backward) X(_softmax) X(_softmax_backward_data) \
  X(_log_softmax) X(_log_softmax_backward_data) X(native_layer_norm)                           \
  X(native_layer_norm_backward)

// Registers the kernels of ACCEL_UNBOXED_OPS in `lib`; returns how many it registered.
template <class Filter, class KindOf>
int add_all(torch::Library& lib, const KindOf& kind_of) {
  int n = 0;
#define ACCEL_ADD(op) n += Unboxed<Filter, at::_ops::op>::add(lib, kind_of);
  ACCEL_UNBOXED_OPS(ACCEL_ADD)
#undef ACCEL_ADD
  return n;
}

}  // namespace accel_unboxed
