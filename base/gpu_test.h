#ifndef DFLASH_BASE_GPU_TEST_H_
#define DFLASH_BASE_GPU_TEST_H_

// The one way a GPU test goes without a GPU: DFLASH_SKIP_WITHOUT_GPU(status)
// skips the test with the reason the device was unusable, or, when
// DFLASH_REQUIRE_GPU=1 (tools/gpu_check.sh sets it on a GPU machine), fails
// it, so that a broken GPU run cannot pass as a run of skips.

#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace dflash {

// Whether this run must have a usable GPU (DFLASH_REQUIRE_GPU=1).
inline bool GpuRequired() {
  const char* value = std::getenv("DFLASH_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

}  // namespace dflash

// `status`: why the device is unusable (OK: it is usable, go on).
#define DFLASH_SKIP_WITHOUT_GPU(status)                                    \
  if (const ::absl::Status dflash_gpu_status_ = (status);                 \
      !dflash_gpu_status_.ok()) {                                         \
    if (::dflash::GpuRequired()) {                                        \
      GTEST_FAIL() << "DFLASH_REQUIRE_GPU=1, but no GPU is usable: "      \
                   << dflash_gpu_status_.message();                       \
    }                                                                     \
    GTEST_SKIP() << "no GPU here: " << dflash_gpu_status_.message();      \
  }

#endif  // DFLASH_BASE_GPU_TEST_H_
