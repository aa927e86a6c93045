#include "base/tracking_allocator.h"

#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dflash {

namespace {

constexpr int64_t kAlign = 64;

int64_t Rounded(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

class Host final : public MemorySpace {
 public:
  Device device() const override { return Device::kCpu; }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    void* data = std::aligned_alloc(kAlign, Rounded(bytes));
    if (data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of host memory allocating ", bytes, " bytes"));
    }
    return data;
  }
  void Free(void* data) override { std::free(data); }
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

MemorySpace& HostMemory() {
  static Host* const host = new Host;
  return *host;
}

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
        absl::StrCat("out of memory: allocating ", bytes,
                     " bytes would exceed the limit of ", limit_bytes_,
                     " bytes (", now - bytes, " in use)"));
  }
  const bool cacheable = cache_blocks_ && bytes >= kMinCachedBytes;
  void* data = cacheable ? TakeCached(bytes) : nullptr;
  if (data == nullptr) {
    absl::StatusOr<void*> fresh = space_.Allocate(Rounded(bytes));
    if (!fresh.ok() && absl::IsResourceExhausted(fresh.status()) &&
        cacheable) {
      ReleaseCache();
      fresh = space_.Allocate(Rounded(bytes));
    }
    if (!fresh.ok()) {
      current_.fetch_sub(bytes);
      return fresh.status();
    }
    data = *fresh;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(mutex_);
      capacity_[data] = Rounded(bytes);
    }
  }
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return data;
}

void* TrackingAllocator::TakeCached(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = cached_.lower_bound(Rounded(bytes));
  if (it == cached_.end() || it->first > bytes + bytes / 2) return nullptr;
  void* data = it->second;
  capacity_[data] = it->first;
  cached_bytes_ -= it->first;
  cached_.erase(it);
  return data;
}

void TrackingAllocator::Free(void* data, int64_t bytes) {
  if (data == nullptr) return;
  current_.fetch_sub(bytes);
  if (cache_blocks_ && bytes >= kMinCachedBytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = capacity_.find(data);
    if (it != capacity_.end()) {
      cached_.emplace(it->second, data);
      cached_bytes_ += it->second;
      capacity_.erase(it);
      return;
    }
  }
  space_.Free(data);
}

int64_t TrackingAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_bytes_;
}

void TrackingAllocator::ReleaseCache() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [capacity, data] : cached_) space_.Free(data);
  cached_.clear();
  cached_bytes_ = 0;
}

}  // namespace dflash
