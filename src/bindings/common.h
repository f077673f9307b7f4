// Conversions shared by the binding files. The binding holds no logic: it turns Python values into the
// public C++ API's types and calls it.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "logitless/logitless.h"

namespace logitless::bindings {

namespace nb = nanobind;

// A tensor travels as None or as the tuple (data_ptr, dtype_code, device_type, device_index, sizes, strides)
// that python/logitless/_tensor.py builds from a torch.Tensor.
TensorView to_view(nb::handle obj);
Workspace to_workspace(nb::handle obj);  // None or (ptr, bytes)
inline StreamHandle to_stream(uintptr_t s) { return reinterpret_cast<StreamHandle>(s); }

// policy_loss.cpp: the outputs, each None (not wanted) or a tensor; linear_policy_loss.cpp takes them too.
PolicyLossOutputs policy_outputs(nb::handle loss, nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped,
                                 nb::handle logp, nb::handle entropy, nb::handle lse);

// An options struct of the public API as a Python class: constructed by keyword only, every field optional with
// the C++ member initializer as its default, each field a named read/write attribute. The fields are declared
// once, with field() / enum_field(); the keyword constructor and the repr set and read them by those names, so
// no list of fields in a fixed order exists anywhere else (the binding functions take the whole struct). A binding
// function copies its options before it releases the GIL: another thread may change the Python object meanwhile.
//   OptionsClass<CrossEntropyOptions>(m, "CrossEntropyOptions").field("z_loss", &CrossEntropyOptions::z_loss)...
template <typename T>
class OptionsClass {
 public:
  OptionsClass(nb::module_& m, const char* name) : cls_(m, name) {
    meta().name = name;
    cls_.def(
        "__init__",
        [](T* self, nb::kwargs kwargs) {
          T o{};
          for (auto [key, value] : kwargs) set(o, nb::str(key).c_str(), value);
          new (self) T(std::move(o));
        },
        "Keyword arguments only: the fields to set; the others keep the C++ defaults.");
    cls_.def("__copy__", [](const T& o) { return T(o); });
    cls_.def("__repr__", [](nb::handle self) {
      std::string s = meta().name + "(";
      const char* sep = "";
      for (const auto& f : meta().fields) {
        s += sep + f.first + "=" + nb::repr(self.attr(f.first.c_str())).c_str();
        sep = ", ";
      }
      return s + ")";
    });
  }

  template <typename F>
  OptionsClass& field(const char* name, F T::*member) {
    cls_.def_rw(name, member);
    meta().fields.emplace_back(name, [member, name](T& o, nb::handle value) {
      if (!nb::try_cast<F>(value, o.*member)) throw_bad_type(name, value);
    });
    return *this;
  }

  // An enum-typed field, read and written as its integer value (the Python side keeps the name -> value tables).
  template <typename E>
  OptionsClass& enum_field(const char* name, E T::*member) {
    cls_.def_prop_rw(
        name, [member](const T& o) { return static_cast<int32_t>(o.*member); },
        [member](T& o, int32_t v) { o.*member = static_cast<E>(v); });
    meta().fields.emplace_back(name, [member, name](T& o, nb::handle value) {
      int32_t v = 0;
      if (!nb::try_cast<int32_t>(value, v)) throw_bad_type(name, value);
      o.*member = static_cast<E>(v);
    });
    return *this;
  }

 private:
  // Filled while the module initializes, read by every construction afterwards.
  struct Meta {
    std::string name;
    std::vector<std::pair<std::string, std::function<void(T&, nb::handle)>>> fields;
  };
  static Meta& meta() {
    static Meta m;
    return m;
  }

  static void set(T& o, const char* key, nb::handle value) {
    for (auto& [name, setter] : meta().fields) {
      if (name == key) return setter(o, value);
    }
    throw nb::type_error((meta().name + ": unexpected keyword argument '" + key + "'").c_str());
  }

  [[noreturn]] static void throw_bad_type(const char* name, nb::handle value) {
    throw nb::type_error((meta().name + "." + name + ": cannot hold " + nb::repr(value).c_str() + " (" +
                          nb::type_name(value.type()).c_str() + ")")
                             .c_str());
  }

  nb::class_<T> cls_;
};

}  // namespace logitless::bindings
