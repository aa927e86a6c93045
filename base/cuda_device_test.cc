#include "base/cuda_device.h"

#include "base/gpu_test.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

TEST(CudaDeviceTest, KernelRunsWhereAGpuIsPresent) {
  absl::StatusOr<int> count = CudaDeviceCount();
  DFLASH_SKIP_WITHOUT_GPU(count.status());
  EXPECT_GT(*count, 0);
  EXPECT_TRUE(CudaSelfTest().ok()) << CudaSelfTest();
}

TEST(CudaDeviceTest, SelfTestWithoutGpuNamesTheReason) {
  if (CudaDeviceCount().ok()) GTEST_SKIP() << "a GPU is present";
  absl::Status status = CudaSelfTest();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(status.message().empty());
}

}  // namespace
}  // namespace dflash
