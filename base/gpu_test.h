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

// The tests of what a run without a GPU says: under the CUDA emulation
// (--config=cuda_emulated) the emulated GPU is hidden for the rest of the
// test, so they run there too; with a real GPU present they skip.
#if defined(DFLASH_CUDA_EMULATED)
#define DFLASH_WITHOUT_GPU_OR_SKIP(gpu_present) \
  ::dflash::ScopedNoEmulatedGpu dflash_no_gpu_
#else
#define DFLASH_WITHOUT_GPU_OR_SKIP(gpu_present) \
  if (gpu_present) GTEST_SKIP() << "a GPU is present"
#endif

namespace dflash {

// Hides the CUDA emulation's GPU for its scope (DFLASH_EMULATED_GPUS=0).
class ScopedNoEmulatedGpu {
 public:
  ScopedNoEmulatedGpu() { setenv("DFLASH_EMULATED_GPUS", "0", 1); }
  ~ScopedNoEmulatedGpu() { unsetenv("DFLASH_EMULATED_GPUS"); }
  ScopedNoEmulatedGpu(const ScopedNoEmulatedGpu&) = delete;
  ScopedNoEmulatedGpu& operator=(const ScopedNoEmulatedGpu&) = delete;
};

}  // namespace dflash

#endif  // DFLASH_BASE_GPU_TEST_H_
