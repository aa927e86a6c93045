#include "base/tracking_allocator.h"

#include <cstdint>

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

}  // namespace
}  // namespace dflash
