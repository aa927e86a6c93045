#include "python/native/tensor_arg.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dflash::python {

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorArg::contiguous() const {
  if (strides.size() != shape.size()) return false;
  int64_t expected = 1;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

int TensorArg::cuda_index() const {
  const size_t colon = device.find(':');
  return colon == std::string::npos ? 0 : std::atoi(device.c_str() + colon + 1);
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

absl::Status ExpectDType(const TensorArg& t,
                         absl::Span<const absl::string_view> allowed,
                         absl::string_view why) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      t.name, ": must be ", absl::StrJoin(allowed, " or "),
      why.empty() ? "" : absl::StrCat(" (", why, ")"), ", got ", t.dtype));
}

absl::Status ExpectShape(const TensorArg& t, absl::Span<const int64_t> shape,
                         absl::string_view dims) {
  if (absl::MakeConstSpan(t.shape) == shape) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(t.name, ": must have shape ", dims, " = ",
                   ShapeString(shape), ", got ", ShapeString(t.shape)));
}

absl::Status ExpectContiguous(const TensorArg& t) {
  if (t.contiguous()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      t.name,
      ": must be contiguous (dflash reads it in place; call .contiguous(), "
      "one copy), got strides ",
      ShapeString(t.strides), " for shape ", ShapeString(t.shape)));
}

absl::Status ExpectDevice(const TensorArg& t, absl::string_view device,
                          absl::string_view why) {
  if (t.device == device) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      t.name, ": must be on ", device, " (", why, "), got ", t.device));
}

}  // namespace dflash::python
