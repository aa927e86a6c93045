#ifndef DFLASH_PYTHON_NATIVE_TENSOR_ARG_H_
#define DFLASH_PYTHON_NATIVE_TENSOR_ARG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dflash::python {

// A tensor as it crosses from Python: torch's metadata and data pointer, no
// ownership and no torch types, so that one build serves every torch
// version. `name` is the Python argument's, for error messages.
struct TensorArg {
  std::string name;
  uintptr_t data = 0;
  std::string dtype;  // torch's name without "torch.": "float32", "int64".
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // In elements, as torch's stride().
  std::string device = "cpu";    // str(tensor.device): "cpu", "cuda:0".

  int64_t numel() const;
  bool contiguous() const;  // C order; size-1 dimensions' strides are free.
  bool on_cuda() const { return device.rfind("cuda", 0) == 0; }
  // The CUDA device index ("cuda" alone is device 0).
  int cuda_index() const;

  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }
  template <typename T>
  absl::Span<T> span() const {
    return absl::Span<T>(as<T>(), static_cast<size_t>(numel()));
  }
};

// Each check returns InvalidArgument as "NAME: must ..., got ...".

// `allowed` lists dtype names; `why` says where they come from.
absl::Status ExpectDType(const TensorArg& t,
                         absl::Span<const absl::string_view> allowed,
                         absl::string_view why = "");
// `dims` names the expected shape for the message, e.g. "[B, N, K, H]".
absl::Status ExpectShape(const TensorArg& t, absl::Span<const int64_t> shape,
                         absl::string_view dims);
absl::Status ExpectContiguous(const TensorArg& t);
absl::Status ExpectDevice(const TensorArg& t, absl::string_view device,
                          absl::string_view why);

// "(2, 3, 4)", as torch prints a shape.
std::string ShapeString(absl::Span<const int64_t> shape);

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_TENSOR_ARG_H_
