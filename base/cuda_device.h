#ifndef DFLASH_BASE_CUDA_DEVICE_H_
#define DFLASH_BASE_CUDA_DEVICE_H_

// CudaDeviceCount and CudaSelfTest: whether this process can use a CUDA
// device, and whether the code was built for its architecture. GPU tests
// call them first, to skip or fail with the reason.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dflash {

// Number of CUDA devices this process can use. When there is none, the error
// says why (no driver, no device), so GPU tests can report why they skipped.
absl::StatusOr<int> CudaDeviceCount();

// Runs one small kernel on device 0 and checks its result against the host:
// proves that the code was built for this GPU's architecture.
absl::Status CudaSelfTest();

}  // namespace dflash

#endif  // DFLASH_BASE_CUDA_DEVICE_H_
