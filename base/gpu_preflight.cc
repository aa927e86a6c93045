// Says whether this machine's GPU can run dflash, before any test does:
// the device, whether it supports stream-ordered memory pools, and a 1 GiB
// stream-ordered allocation, copy and free. Exit 1, with the reason, on any
// failure (tools/gpu_check.sh run stops there instead of reporting skips).
#include <cuda_runtime.h>

#include <cstdio>

namespace {

bool Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return true;
  std::printf("preflight: %s failed: %s\n", what, cudaGetErrorString(error));
  return false;
}

}  // namespace

int main() {
  int count = 0;
  if (!Check(cudaGetDeviceCount(&count), "cudaGetDeviceCount")) return 1;
  if (count == 0) {
    std::printf("preflight: no CUDA device is visible\n");
    return 1;
  }
  cudaDeviceProp props;
  if (!Check(cudaGetDeviceProperties(&props, 0), "cudaGetDeviceProperties")) {
    return 1;
  }
  int pools = 0;
  if (!Check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0),
             "cudaDeviceGetAttribute")) {
    return 1;
  }
  std::printf("preflight: %d device(s); device 0 is %s, sm_%d%d, %.1f GiB; "
              "memory pools %s\n",
              count, props.name, props.major, props.minor,
              props.totalGlobalMem / 1073741824.0,
              pools ? "supported" : "NOT supported");
  if (!pools) return 1;
  cudaStream_t stream;
  if (!Check(cudaStreamCreate(&stream), "cudaStreamCreate")) return 1;
  constexpr size_t kBytes = size_t{1} << 30;
  void* data = nullptr;
  const bool ok =
      Check(cudaMallocAsync(&data, kBytes, stream), "cudaMallocAsync 1 GiB") &&
      Check(cudaMemsetAsync(data, 0, kBytes, stream), "cudaMemsetAsync") &&
      Check(cudaFreeAsync(data, stream), "cudaFreeAsync") &&
      Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaStreamDestroy(stream);
  if (!ok) return 1;
  std::printf("preflight: a 1 GiB stream-ordered allocation, memset and free "
              "worked\n");
  return 0;
}
