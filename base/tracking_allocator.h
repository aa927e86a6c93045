#ifndef DFLASH_BASE_TRACKING_ALLOCATOR_H_
#define DFLASH_BASE_TRACKING_ALLOCATOR_H_

// TrackingAllocator counts current and peak bytes, with an optional limit
// and block cache; TrackedBuffer is an owning buffer drawn from it. Use them
// for every buffer whose memory a run must measure or bound; a MemorySpace
// extends the same accounting to CUDA device memory.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

#include "absl/status/statusor.h"
#include "base/device.h"

namespace dflash {

// Where a TrackingAllocator's bytes live and how they are copied: host
// memory by default; a CUDA backend passes device memory (//base:cuda_memory,
// stream-ordered), so that device bytes are counted the same way.
class MemorySpace {
 public:
  virtual ~MemorySpace() = default;
  virtual Device device() const = 0;
  // At least 64-byte aligned. Errors say why: ResourceExhausted when out
  // of memory, another code for anything else (no memory pools, a lost
  // device), with the runtime's reason.
  virtual absl::StatusOr<void*> Allocate(int64_t bytes) = 0;
  // A failure that shows only later (a stream-ordered free) is reported by
  // the space's own synchronisation.
  virtual void Free(void* data) = 0;
  // Copies `bytes` within this space, ordered with the space's other work.
  virtual absl::Status Copy(void* dst, const void* src, int64_t bytes) = 0;
};

// Host memory (aligned_alloc, memcpy).
MemorySpace& HostMemory();

// Allocator that counts current and peak bytes, so peak memory is
// measured, not guessed, and a test can assert it. Thread-safe. An optional
// limit turns an allocation beyond it into ResourceExhausted.
//
// With `cache_blocks`, freed blocks of at least kMinCachedBytes are kept and
// handed to later requests that fit them (at most 1.5x larger), as PyTorch's
// caching allocator does: a training loop that calls the head every step
// then touches no fresh pages after the first (the kernel zeroes each fresh
// page on first touch, which costs ~5-20% of a chunk's GEMM time). Counts
// are of live requested bytes either way; cached_bytes() says what is held
// on top.
class TrackingAllocator {
 public:
  static constexpr int64_t kMinCachedBytes = int64_t{1} << 20;

  explicit TrackingAllocator(
      int64_t limit_bytes = std::numeric_limits<int64_t>::max(),
      bool cache_blocks = false, MemorySpace& space = HostMemory())
      : limit_bytes_(limit_bytes), cache_blocks_(cache_blocks), space_(space) {}
  TrackingAllocator(const TrackingAllocator&) = delete;
  TrackingAllocator& operator=(const TrackingAllocator&) = delete;
  ~TrackingAllocator() { ReleaseCache(); }

  // 64-byte aligned; bytes must be >= 0 (0 gives a null pointer).
  absl::StatusOr<void*> Allocate(int64_t bytes);
  void Free(void* data, int64_t bytes);

  Device device() const { return space_.device(); }
  // Copies within the allocator's memory space.
  absl::Status Copy(void* dst, const void* src, int64_t bytes) {
    return space_.Copy(dst, src, bytes);
  }

  int64_t current_bytes() const { return current_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  int64_t limit_bytes() const { return limit_bytes_; }
  // Starts a new peak measurement from the current usage.
  void ResetPeak() { peak_.store(current_.load()); }

  // Bytes of freed blocks held for reuse (0 without cache_blocks).
  int64_t cached_bytes() const;
  // Returns the cached blocks to the system.
  void ReleaseCache();

 private:
  // A cached block of at least `bytes` that fits, or null.
  void* TakeCached(int64_t bytes);

  const int64_t limit_bytes_;
  const bool cache_blocks_;
  MemorySpace& space_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  mutable std::mutex mutex_;
  std::multimap<int64_t, void*> cached_;     // Capacity -> free block.
  std::map<void*, int64_t> capacity_;        // Live cacheable blocks.
  int64_t cached_bytes_ = 0;
};

// An owning, movable buffer of `size` elements of T from a TrackingAllocator.
// Contents start uninitialised.
template <typename T>
class TrackedBuffer {
 public:
  TrackedBuffer() = default;
  static absl::StatusOr<TrackedBuffer> Create(TrackingAllocator& allocator,
                                              int64_t size) {
    absl::StatusOr<void*> data =
        allocator.Allocate(size * static_cast<int64_t>(sizeof(T)));
    if (!data.ok()) return data.status();
    return TrackedBuffer(&allocator, static_cast<T*>(*data), size);
  }
  TrackedBuffer(TrackedBuffer&& other) noexcept { *this = std::move(other); }
  TrackedBuffer& operator=(TrackedBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      std::swap(allocator_, other.allocator_);
      std::swap(data_, other.data_);
      std::swap(size_, other.size_);
    }
    return *this;
  }
  ~TrackedBuffer() { Reset(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  int64_t size() const { return size_; }
  int64_t bytes() const { return size_ * static_cast<int64_t>(sizeof(T)); }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }

  void Reset() {
    if (allocator_ != nullptr) allocator_->Free(data_, bytes());
    allocator_ = nullptr;
    data_ = nullptr;
    size_ = 0;
  }

 private:
  TrackedBuffer(TrackingAllocator* allocator, T* data, int64_t size)
      : allocator_(allocator), data_(data), size_(size) {}
  TrackingAllocator* allocator_ = nullptr;
  T* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace dflash

#endif  // DFLASH_BASE_TRACKING_ALLOCATOR_H_
