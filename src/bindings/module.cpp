#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings/common.h"
#include "common/debug_hooks.h"

namespace logitless::bindings {

TensorView to_view(nb::handle obj) {
  if (obj.is_none()) return TensorView{};
  auto t = nb::cast<nb::tuple>(obj);
  if (t.size() != 6) throw Error(Error::Kind::kInvalidArgument, "tensor descriptor: expected a 6-tuple");
  const auto ptr = nb::cast<uintptr_t>(t[0]);
  const auto dtype = static_cast<DType>(nb::cast<int32_t>(t[1]));
  const Device dev{static_cast<DeviceType>(nb::cast<int32_t>(t[2])), nb::cast<int32_t>(t[3])};
  const auto sizes = nb::cast<std::vector<int64_t>>(t[4]);
  const auto strides = nb::cast<std::vector<int64_t>>(t[5]);
  if (sizes.size() != strides.size() || sizes.size() > static_cast<size_t>(kMaxDims))
    throw Error(Error::Kind::kInvalidArgument, "tensor descriptor: sizes and strides must match, at most 8 dims");
  return TensorView::make(reinterpret_cast<void*>(ptr), dtype, dev, static_cast<int32_t>(sizes.size()), sizes.data(),
                          strides.data());
}

Workspace to_workspace(nb::handle obj) {
  if (obj.is_none()) return Workspace{};
  auto t = nb::cast<nb::tuple>(obj);
  return Workspace{reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0])), nb::cast<size_t>(t[1])};
}

void bind_cross_entropy(nb::module_& m);
void bind_glu(nb::module_& m);
void bind_linear_cross_entropy(nb::module_& m);
void bind_linear_policy_loss(nb::module_& m);
void bind_policy_loss(nb::module_& m);
void bind_rms_norm(nb::module_& m);
void bind_rope(nb::module_& m);
void bind_vocab_parallel(nb::module_& m);

}  // namespace logitless::bindings

NB_MODULE(_C, m) {
  namespace nb = nanobind;
  using namespace logitless;
  m.doc() = "logitless: fused LLM training-loss kernels (C++ core)";
  // Bad arguments become ValueError, everything else RuntimeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(e.kind() == Error::Kind::kInvalidArgument ? PyExc_ValueError : PyExc_RuntimeError, e.what());
    }
  });
  m.def("version", &version);
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_device_count", &cuda_device_count);
  // Benchmark harnesses only (bench/lce_probe.py): a switch of src/common/debug_hooks.h by name; False if none.
  m.def("_set_debug_hook", [](const std::string& name, int64_t value) { return debug::set_hook(name.c_str(), value); });
  bindings::bind_cross_entropy(m);
  bindings::bind_glu(m);
  bindings::bind_linear_cross_entropy(m);
  bindings::bind_linear_policy_loss(m);
  bindings::bind_policy_loss(m);
  bindings::bind_rms_norm(m);
  bindings::bind_rope(m);
  bindings::bind_vocab_parallel(m);
}
