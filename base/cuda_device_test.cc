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
  DFLASH_WITHOUT_GPU_OR_SKIP(CudaDeviceCount().ok());
  absl::Status status = CudaSelfTest();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(status.message().empty());
}

}  // namespace
}  // namespace dflash
