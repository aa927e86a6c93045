#ifndef DFLASH_BASE_TENSOR_H_
#define DFLASH_BASE_TENSOR_H_

// TensorView, a non-owning view of strided tensor memory (data, shape,
// strides, element type, Device), and DType, the element types it holds.
// Reach for it to pass tensors between stages without copying, or to slice
// one along a dimension (TensorView::Slice), as the chunked reduction does.

#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/bfloat16.h"
#include "base/device.h"

namespace dflash {

enum class DType { kFloat32, kFloat64, kBFloat16, kInt32, kInt64, kBool };

int64_t ElementBytes(DType dtype);
const char* DTypeName(DType dtype);

using Shape = absl::InlinedVector<int64_t, 4>;

// A non-owning view of a strided tensor: data, shape, strides (in elements),
// dtype and device. Slicing returns another view of the same memory.
class TensorView {
 public:
  TensorView() = default;
  // A contiguous (C order) view of `shape`.
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::kCpu);
  TensorView(void* data, DType dtype, Shape shape, Shape strides,
             Device device = Device::kCpu);

  template <typename T>
  static TensorView Of(T* data, Shape shape);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim(int64_t i) const { return shape_[i]; }
  int64_t numel() const;
  int64_t bytes() const { return numel() * ElementBytes(dtype_); }
  bool is_contiguous() const;

  // Elements [start, start + length) of dimension `dim` (0 <= dim < rank).
  absl::StatusOr<TensorView> Slice(int64_t dim, int64_t start,
                                   int64_t length) const;

  // "float32[2, 6]".
  std::string DebugString() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Device device_ = Device::kCpu;
  Shape shape_;
  Shape strides_;
};

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <>
struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };
template <>
struct DTypeOf<BFloat16> { static constexpr DType value = DType::kBFloat16; };
template <>
struct DTypeOf<int32_t> { static constexpr DType value = DType::kInt32; };
template <>
struct DTypeOf<int64_t> { static constexpr DType value = DType::kInt64; };
template <>
struct DTypeOf<bool> { static constexpr DType value = DType::kBool; };

template <typename T>
TensorView TensorView::Of(T* data, Shape shape) {
  return TensorView(const_cast<std::remove_const_t<T>*>(data),
                    DTypeOf<std::remove_const_t<T>>::value, std::move(shape));
}

}  // namespace dflash

#endif  // DFLASH_BASE_TENSOR_H_
