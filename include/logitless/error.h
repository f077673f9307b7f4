// logitless: the one error type. Every failure (bad argument, CUDA error) is thrown as logitless::Error;
// nothing in the library exits or prints and continues.
#pragma once

#include <stdexcept>
#include <string>

namespace logitless {

class Error : public std::runtime_error {
 public:
  enum class Kind {
    kInvalidArgument,  // the caller passed something the op does not accept (Python: ValueError)
    kRuntime,          // the op could not run (CUDA error, missing backend) (Python: RuntimeError)
  };
  Error(Kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

}  // namespace logitless
