#include "base/tensor.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dflash {

int64_t ElementBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kBool:
      return 1;
  }
  return 1;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

namespace {
Shape ContiguousStrides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}
}  // namespace

TensorView::TensorView(void* data, DType dtype, Shape shape, Device device)
    : data_(data), dtype_(dtype), device_(device), shape_(std::move(shape)) {
  strides_ = ContiguousStrides(shape_);
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides,
                       Device device)
    : data_(data),
      dtype_(dtype),
      device_(device),
      shape_(std::move(shape)),
      strides_(std::move(strides)) {}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  return strides_ == ContiguousStrides(shape_);
}

absl::StatusOr<TensorView> TensorView::Slice(int64_t dim, int64_t start,
                                             int64_t length) const {
  if (dim < 0 || dim >= rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dim ", dim, " is invalid for a ", rank(), "D tensor"));
  }
  if (start < 0 || length < 0 || start + length > shape_[dim]) {
    return absl::OutOfRangeError(
        absl::StrCat("slice [", start, ", ", start + length, ") of dim ", dim,
                     " is outside ", DebugString()));
  }
  TensorView view = *this;
  view.shape_[dim] = length;
  // An empty tensor may have no memory at all: no offset from null.
  if (data_ != nullptr) {
    view.data_ = static_cast<char*>(data_) +
                 start * strides_[dim] * ElementBytes(dtype_);
  }
  return view;
}

std::string TensorView::DebugString() const {
  return absl::StrCat(DTypeName(dtype_), "[", absl::StrJoin(shape_, ", "), "]");
}

}  // namespace dflash
