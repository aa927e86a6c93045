#include "base/tracking_allocator.h"

#include <cstdint>
#include <limits>
#include <utility>

#include "gtest/gtest.h"

namespace dflash {
namespace {

TEST(TrackingAllocatorTest, CountsCurrentAndPeak) {
  TrackingAllocator allocator;
  {
    auto a = TrackedBuffer<float>::Create(allocator, 100);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(allocator.current_bytes(), 400);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    {
      auto b = TrackedBuffer<double>::Create(allocator, 10);
      ASSERT_TRUE(b.ok());
      EXPECT_EQ(allocator.current_bytes(), 480);
    }
    EXPECT_EQ(allocator.current_bytes(), 400);
    TrackedBuffer<float> moved = *std::move(a);
    EXPECT_EQ(allocator.current_bytes(), 400);
  }
  EXPECT_EQ(allocator.current_bytes(), 0);
  EXPECT_EQ(allocator.peak_bytes(), 480);
  allocator.ResetPeak();
  EXPECT_EQ(allocator.peak_bytes(), 0);
}

TEST(TrackingAllocatorTest, LimitIsAStatusNotAnAbort) {
  TrackingAllocator allocator(1000);
  auto fits = TrackedBuffer<char>::Create(allocator, 600);
  ASSERT_TRUE(fits.ok());
  auto too_big = TrackedBuffer<char>::Create(allocator, 600);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(allocator.current_bytes(), 600);
  EXPECT_EQ(allocator.Allocate(-1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TrackingAllocatorTest, HugeRequestFailsCleanly) {
  TrackingAllocator allocator;
  auto huge = allocator.Allocate(int64_t{1} << 62);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(allocator.current_bytes(), 0);
}

// Freed large blocks come back to requests that fit them; counts stay those
// of live bytes; small blocks and misfits are not cached.
TEST(TrackingAllocatorTest, CachedBlocksAreReused) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  TrackingAllocator allocator(std::numeric_limits<int64_t>::max(),
                              /*cache_blocks=*/true);
  void* first = *allocator.Allocate(4 * kMiB);
  allocator.Free(first, 4 * kMiB);
  EXPECT_EQ(allocator.current_bytes(), 0);
  EXPECT_EQ(allocator.cached_bytes(), 4 * kMiB);
  void* again = *allocator.Allocate(3 * kMiB);  // Fits: 4 <= 1.5 * 3.
  EXPECT_EQ(again, first);
  EXPECT_EQ(allocator.cached_bytes(), 0);
  EXPECT_EQ(allocator.current_bytes(), 3 * kMiB);
  EXPECT_EQ(allocator.peak_bytes(), 4 * kMiB);
  allocator.Free(again, 3 * kMiB);
  EXPECT_EQ(allocator.cached_bytes(), 4 * kMiB);  // Its whole capacity.
  void* small = *allocator.Allocate(2 * kMiB);  // 4 > 1.5 * 2: a new block.
  EXPECT_NE(small, first);
  EXPECT_EQ(allocator.cached_bytes(), 4 * kMiB);
  allocator.Free(small, 2 * kMiB);
  void* tiny = *allocator.Allocate(1000);
  allocator.Free(tiny, 1000);
  EXPECT_EQ(allocator.cached_bytes(), 6 * kMiB);
  allocator.ReleaseCache();
  EXPECT_EQ(allocator.cached_bytes(), 0);
  EXPECT_EQ(allocator.current_bytes(), 0);
}

TEST(TrackingAllocatorTest, WithoutCachingNothingIsHeld) {
  TrackingAllocator allocator;
  void* block = *allocator.Allocate(int64_t{8} << 20);
  allocator.Free(block, int64_t{8} << 20);
  EXPECT_EQ(allocator.cached_bytes(), 0);
}

// A memory space whose allocations fail with a given status, counting the
// attempts (the caching allocator retries once after releasing its cache,
// but only when the space is out of memory).
class FailingSpace final : public MemorySpace {
 public:
  explicit FailingSpace(absl::Status error) : error_(std::move(error)) {}
  Device device() const override { return Device::kCuda; }
  absl::StatusOr<void*> Allocate(int64_t) override {
    ++attempts;
    return error_;
  }
  void Free(void*) override {}
  absl::Status Copy(void*, const void*, int64_t) override {
    return absl::OkStatus();
  }
  int attempts = 0;

 private:
  const absl::Status error_;
};

TEST(TrackingAllocatorTest, TheSpacesReasonForAFailureIsKept) {
  FailingSpace no_pools(absl::InternalError(
      "allocating 4194304 bytes of CUDA memory (cudaMallocAsync): operation "
      "not supported"));
  TrackingAllocator allocator(std::numeric_limits<int64_t>::max(),
                              /*cache_blocks=*/true, no_pools);
  const absl::Status status = allocator.Allocate(int64_t{4} << 20).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(),
            "allocating 4194304 bytes of CUDA memory (cudaMallocAsync): "
            "operation not supported");
  EXPECT_EQ(no_pools.attempts, 1);  // Not out of memory: no retry.
  EXPECT_EQ(allocator.current_bytes(), 0);

  FailingSpace full(absl::ResourceExhaustedError("out of memory"));
  TrackingAllocator cached(std::numeric_limits<int64_t>::max(),
                           /*cache_blocks=*/true, full);
  EXPECT_EQ(cached.Allocate(int64_t{4} << 20).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.attempts, 2);  // Retried after releasing the cache.
  EXPECT_EQ(cached.current_bytes(), 0);
}

}  // namespace
}  // namespace dflash
