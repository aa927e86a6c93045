#include "base/tracking_allocator.h"

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dflash {

absl::StatusOr<void*> TrackingAllocator::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("allocation size must be >= 0, got ", bytes));
  }
  if (bytes == 0) return nullptr;
  const int64_t now = current_.fetch_add(bytes) + bytes;
  if (now > limit_bytes_ || now < 0) {
    current_.fetch_sub(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes would exceed the limit of ",
                     limit_bytes_, " bytes (", now - bytes, " in use)"));
  }
  constexpr int64_t kAlign = 64;
  void* data = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  if (data == nullptr) {
    current_.fetch_sub(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("out of host memory allocating ", bytes, " bytes"));
  }
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return data;
}

void TrackingAllocator::Free(void* data, int64_t bytes) {
  if (data == nullptr) return;
  std::free(data);
  current_.fetch_sub(bytes);
}

}  // namespace dflash
