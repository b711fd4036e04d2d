// speclm: C entry points for the ops a compiled step calls, for inductor's C++ wrapper.
//
// A compiled CPU step is a wrapper that calls inductor's fused loops and, between them, speclm's
// ops (the GGUF block products, attention). Inductor writes that wrapper in Python by default,
// and each op call from it costs several microseconds of argument parsing and dispatch: with ~150
// op calls and ~120 fused loops in a one-token step of the default model, more than a millisecond
// of a ~8 ms step. With `cpp_wrapper` the wrapper is C++, and an op with a C entry point named
// aoti_torch_cpu_<op> (listed in inductor's aot_inductor.custom_ops_to_c_shims, see
// models/c_shims.py) is called directly; an op without one would go back through Python, slower
// than before. So every op a compiled graph can hold has its entry point here, each calling the op
// through the dispatcher: the same kernel, the same bits.
//
// The signatures are the ones inductor writes for the ops' schemas: a Tensor is an
// AtenTensorHandle, a Tensor? a pointer to one (null: none), a bool an int32_t, an int[] a pointer
// and a length, each output an AtenTensorHandle* the entry point fills.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

namespace {

using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

const at::Tensor& in(AtenTensorHandle handle) { return *tensor_handle_to_tensor_pointer(handle); }

c10::optional<at::Tensor> maybe(AtenTensorHandle* handle) {
  return handle != nullptr ? c10::optional<at::Tensor>(in(*handle)) : c10::nullopt;
}

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Blocks = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                          int64_t);

}  // namespace

extern "C" {

AOTITorchError aoti_torch_cpu_small_m_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<at::Tensor(const at::Tensor&, const at::Tensor&)>("speclm::small_m_mm");
    *ret0 = new_tensor_handle(call.call(in(x), in(w)));
  });
}

AOTITorchError aoti_torch_cpu_small_m_blocks(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scale,
                                             AtenTensorHandle* minimum, int64_t bits, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<Blocks>("speclm::small_m_blocks");
    *ret0 = new_tensor_handle(call.call(in(x), in(codes), in(scale), maybe(minimum), bits));
  });
}

AOTITorchError aoti_torch_cpu_small_m_blocks_q8(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scale,
                                                AtenTensorHandle* minimum, int64_t bits, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<Blocks>("speclm::small_m_blocks_q8");
    *ret0 = new_tensor_handle(call.call(in(x), in(codes), in(scale), maybe(minimum), bits));
  });
}

AOTITorchError aoti_torch_cpu_dequantize_blocks(AtenTensorHandle codes, AtenTensorHandle scale,
                                                AtenTensorHandle* minimum, int64_t bits, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                           int64_t)>("speclm::dequantize_blocks");
    *ret0 = new_tensor_handle(call.call(in(codes), in(scale), maybe(minimum), bits));
  });
}

AOTITorchError aoti_torch_cpu_registered_blocks(AtenTensorHandle x, int64_t handle, int32_t q8, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<at::Tensor(const at::Tensor&, int64_t, bool)>("speclm::registered_blocks");
    *ret0 = new_tensor_handle(call.call(in(x), handle, q8 != 0));
  });
}

AOTITorchError aoti_torch_cpu_registered_blocks_group(AtenTensorHandle x, const int64_t* handles, int64_t count,
                                                      AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<at::Tensor(const at::Tensor&, at::IntArrayRef)>("speclm::registered_blocks_group");
    *ret0 = new_tensor_handle(call.call(in(x), at::IntArrayRef(handles, count)));
  });
}

AOTITorchError aoti_torch_cpu_small_m_attention(AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
                                                AtenTensorHandle* mask, double scale, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto call = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const c10::optional<at::Tensor>&, double)>("speclm::small_m_attention");
    *ret0 = new_tensor_handle(call.call(in(query), in(key), in(value), maybe(mask), scale));
  });
}

}  // extern "C"
