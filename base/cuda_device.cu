#include "base/cuda_device.h"

#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda_launch.h"

namespace dflash {
namespace {

absl::Status CudaError(cudaError_t error, const char* what) {
  return absl::UnavailableError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

__global__ void Axpy(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return CudaError(error, "cudaGetDeviceCount");
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  return count;
}

absl::Status CudaSelfTest() {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  constexpr int kN = 1000;
  std::vector<float> x(kN), y(kN);
  for (int i = 0; i < kN; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  float* device = nullptr;
  cudaError_t error = cudaMalloc(&device, 2 * kN * sizeof(float));
  if (error != cudaSuccess) return CudaError(error, "cudaMalloc");
  cudaMemcpy(device, x.data(), kN * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(device + kN, y.data(), kN * sizeof(float), cudaMemcpyHostToDevice);
  DFLASH_LAUNCH(Axpy, (kN + 255) / 256, 256, 0, 0)
  (kN, 2.0f, device, device + kN);
  error = cudaGetLastError();
  if (error == cudaSuccess) {
    error = cudaMemcpy(y.data(), device + kN, kN * sizeof(float),
                       cudaMemcpyDeviceToHost);
  }
  cudaFree(device);
  if (error != cudaSuccess) return CudaError(error, "Axpy kernel");
  for (int i = 0; i < kN; ++i) {
    if (y[i] != 1.0f + 2.0f * x[i]) {
      return absl::InternalError(absl::StrCat("Axpy kernel: y[", i, "] = ",
                                              y[i], ", expected ",
                                              1.0f + 2.0f * x[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace dflash
